"""The job layer: a YAML job file -> rows -> engine -> checkpoints -> Parquet. The only place engine and io meet."""
