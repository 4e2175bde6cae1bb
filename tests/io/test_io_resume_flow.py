"""The job runner's use of the I/O layer end to end: read, key, skip done keys, checkpoint, crash, resume,
change a parameter for some rows, finalize with the current keys only."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
from io_helpers import write_jsonl

from mlxbatch.io import (
    CheckpointStore,
    ExpectedRow,
    InputRow,
    InputSpec,
    ResultRecord,
    canonical_params,
    finalize,
    open_reader,
    result_key,
)


def _key(row: InputRow, temperature: float) -> str:
    prompt = f"Q: {row.fields.get('q')}"
    return result_key(row.row_id, prompt, "model@rev", canonical_params({"temperature": temperature}), 0)


def _temperature(row: InputRow, hot_ids: set[str]) -> float:
    return 0.7 if row.row_id in hot_ids else 0.0


def _run(spec: InputSpec, out: Path, hot: set[str], stop_after: int | None = None) -> list[str]:
    """One run of a fake job; returns the ids it generated. ``stop_after`` simulates a crash."""
    generated: list[str] = []
    with CheckpointStore(out) as store:
        done = store.done_keys()
        batch: list[ResultRecord] = []
        for row in open_reader(spec):
            temperature = _temperature(row, hot)
            key = _key(row, temperature)
            if key in done:
                continue
            if stop_after is not None and len(generated) == stop_after:
                return generated  # crash: the unflushed batch is lost
            if row.error is not None:
                record = ResultRecord.failed(row.row_id, key, row.error, "input")
            else:
                record = ResultRecord(row_id=row.row_id, key=key, inputs={"q": row.fields["q"]},
                                      text=f"A{temperature}: {row.fields['q']}", finish_reason="stop",
                                      model="model@rev", params=canonical_params({"temperature": temperature}))
            generated.append(row.row_id)
            batch.append(record)
            if len(batch) == 3:
                store.append(batch)
                batch = []
        if batch:
            store.append(batch)
    return generated


def test_resume_is_exactly_once_and_a_parameter_change_reruns_only_its_rows(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "q": f"q{i}"} for i in range(10)])
    with open(data, "a") as f:
        f.write("{broken\n")
    spec, out = InputSpec(data, id_column="id"), tmp_path / "out"

    first = _run(spec, out, hot=set(), stop_after=7)  # crash after 7 rows: 6 were checkpointed
    assert first == [f"r{i}" for i in range(7)]
    second = _run(spec, out, hot=set())
    assert second == ["r6", "r7", "r8", "r9", "in.jsonl:11"]
    assert _run(spec, out, hot=set()) == []  # nothing left to do
    third = _run(spec, out, hot={"r2", "r5"})  # a parameter changed for two rows
    assert third == ["r2", "r5"]

    expected = (ExpectedRow(row.row_id, _key(row, _temperature(row, {"r2", "r5"}))) for row in open_reader(spec))
    with CheckpointStore(out) as store:
        result = finalize(store, out, expected, keep_columns=["q"])
    table = pq.read_table(result.results_path).to_pylist()
    assert [r["id"] for r in table] == [f"r{i}" for i in range(10)] + ["in.jsonl:11"]
    assert table[2]["text"] == "A0.7: q2" and table[3]["text"] == "A0.0: q3"
    assert table[-1]["error"].endswith("in.jsonl:11: invalid JSON: Expecting property name enclosed in double "
                                       "quotes (column 2)") and table[-1]["error_kind"] == "input"
    assert result.stale_records == 2 and result.error_rows == 1
