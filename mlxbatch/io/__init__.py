"""The I/O layer: read inputs as a stream of rows, checkpoint finished rows exactly once, write final outputs.

May import only ``mlxbatch.types`` / ``mlxbatch.errors`` / ``mlxbatch.config`` and third-party libraries; never
the engine or the job layer. Typical use by the job runner::

    rows = open_reader(InputSpec("data/*.jsonl", id_column="id"))
    with CheckpointStore(out_dir) as store:
        done = store.done_keys()
        ...  # render, key = result_key(...), skip keys in done, run the rest, store.append([...]) in batches
        finalize(store, out_dir, expected=(ExpectedRow(row_id, key) for ...), keep_columns=[...])
    write_report(out_dir, report); mark_success(out_dir)
"""

from mlxbatch.io.card import write_dataset_card
from mlxbatch.io.checkpoint import CheckpointStore
from mlxbatch.io.errors import CheckpointError, IncompleteResultsError, InputError, OutputError
from mlxbatch.io.keys import DuplicateIdTracker, canonical_params, result_key
from mlxbatch.io.manifest import ShardInfo
from mlxbatch.io.openai_output import OpenAIBatchOutputs, write_openai_batch_output
from mlxbatch.io.output_folder import (
    PROGRESS_NAME,
    clear_success,
    foreign_files,
    mark_success,
    published_report,
    remove_outputs,
    write_report,
)
from mlxbatch.io.readers import (
    InputFormat,
    InputSpec,
    ResolvedInput,
    count_rows,
    input_schema,
    open_reader,
    resolve_inputs,
)
from mlxbatch.io.records import InputRow, ResultRecord
from mlxbatch.io.recovery import RecoveryReport
from mlxbatch.io.schema import SHARD_SCHEMA, from_arrow, to_arrow
from mlxbatch.io.selection import ExpectedRow
from mlxbatch.io.writers import FinalOutputs, finalize, input_column_names, input_planner

__all__ = [
    "PROGRESS_NAME", "SHARD_SCHEMA", "CheckpointError", "CheckpointStore", "DuplicateIdTracker", "ExpectedRow", "FinalOutputs",
    "IncompleteResultsError", "InputError", "InputFormat", "InputRow", "InputSpec", "OpenAIBatchOutputs",
    "OutputError", "RecoveryReport", "ResolvedInput", "ResultRecord", "ShardInfo", "canonical_params",
    "clear_success", "count_rows", "finalize", "foreign_files", "from_arrow", "input_column_names", "input_planner", "input_schema",
    "mark_success", "open_reader", "published_report", "remove_outputs", "resolve_inputs", "result_key", "to_arrow", "write_dataset_card",
    "write_openai_batch_output", "write_report",
]
