"""Pre-flight: what is checked before any work — the job against its input and model (``validate``), the model
without its weights (``model_ref``, ``model_size``), the shortest output a constraint allows (``shortest``), and who
may write the output folder (``outdir``)."""
