"""``mlxbatch plan``: the run planned without running it (``predict``: its prefill predicted by a dry run of the
engine's own scheduling, ``engine.DryRun``) and its ETA measured on the model (``calibrate``)."""
