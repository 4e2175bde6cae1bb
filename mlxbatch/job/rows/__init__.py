"""A job's rows on their way to an engine: rendered (``prompts`` in the ``sandbox``), prepared with their parameters,
seed and result key (``prepare``), their images (``media``), fed in planned windows (``feed``) and submitted as
tasks whose outputs become result records (``tasks``)."""
