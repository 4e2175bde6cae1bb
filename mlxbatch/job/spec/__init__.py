"""The job file, parsed and validated in exactly one place: ``JobSpec`` and its sections.

``job`` assembles the ``JobSpec`` from the file as a whole; ``sections`` (model, input, prompt, sampling, checkpoint,
engine, plan), ``task`` (task, score, output constraint), ``executor`` (local | ray) parse one section each and report
to the ``Checker`` (``checker``); ``overrides`` applies ``--set`` / ``--limit`` / ``--output`` before parsing.
"""

from mlxbatch.job.spec.job import (
    SAMPLING_KEYS,
    CheckpointSection,
    EngineSection,
    ExecutorSection,
    InputSection,
    JobSpec,
    JobSpecError,
    ModelSection,
    PlanSection,
    PromptSection,
    SamplingSection,
    TaskSection,
    constraint_from,
    load_job,
    parse_job,
    with_executor,
)

__all__ = ["SAMPLING_KEYS", "CheckpointSection", "EngineSection", "ExecutorSection", "InputSection", "JobSpec",
           "JobSpecError", "ModelSection", "PlanSection", "PromptSection", "SamplingSection", "TaskSection",
           "constraint_from", "load_job", "parse_job", "with_executor"]
