"""``mlxbatch plan``: the run planned without running it (``predict``), its prefill predicted (``reuse_model``) and
its ETA measured on the model (``calibrate``)."""
