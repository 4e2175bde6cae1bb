"""One run of a job: the loop (``runner``), its error budget (``error_rate``), signals (``stopping``), what it keeps
in the manifest (``run_meta``) and keeping a Mac awake while it runs (``awake``)."""
