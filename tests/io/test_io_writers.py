"""finalize -> results.parquet (input order, current keys only, typed input columns), OpenAI batch output,
report and success marker."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from io_helpers import make_record

from mlxbatch.io import (
    CheckpointStore,
    ExpectedRow,
    IncompleteResultsError,
    clear_success,
    finalize,
    mark_success,
    write_openai_batch_output,
    write_report,
)
from mlxbatch.types import TokenLogprob

IDS = [f"id{i}" for i in range(25)]


def _fill(store: CheckpointStore, *, params: str = "{}") -> None:
    """Rows finish out of input order, in shards of 4; id7 failed."""
    order = IDS[::2] + IDS[1::2]
    records = [make_record(i, params=params, inputs={"q": f"question {i}", "n": int(i[2:]), "num": 1.5 if i == "id3"
                                                     else int(i[2:]), "meta": {"k": i}, "mixed": "x" if i == "id4"
                                                     else 4})
               if i != "id7" else make_record(i, params=params, text=None, error="engine fell over",
                                              error_kind="engine", finish_reason="error", inputs={"q": "question id7"})
               for i in order]
    for start in range(0, len(records), 4):
        store.append(records[start:start + 4])


def _expected(params: str = "{}") -> list[ExpectedRow]:
    return [ExpectedRow(i, make_record(i, params=params).key) for i in IDS]


def test_finalize_writes_one_row_per_input_row_in_input_order(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path) as store:
        _fill(store, params='{"temperature":1}')  # an earlier run with other parameters: stale
        _fill(store)
        out = finalize(store, tmp_path, iter(_expected()), keep_columns=None, row_group_size=10)
    assert out.rows == 25 and out.error_rows == 1 and out.ok_rows == 24 and out.missing_rows == 0
    assert out.stale_records == 25 and not out.has_logprobs
    assert out.input_columns == ("q", "n", "num", "meta", "mixed")
    pf = pq.ParquetFile(out.results_path)
    assert pf.num_row_groups == 3
    table = pf.read()
    assert table.column_names[:7] == ["id", "key", "q", "n", "num", "meta", "mixed"]
    assert "logprobs" not in table.column_names and "extra" not in table.column_names
    assert table.column("id").to_pylist() == IDS
    assert set(table.column("params").to_pylist()) == {"{}"}
    assert str(table.schema.field("num").type) == "double" and str(table.schema.field("n").type) == "int64"
    assert table.column("meta").to_pylist()[1] == {"k": "id1"}
    mixed = table.column("mixed").to_pylist()
    assert mixed[4] == '"x"' and mixed[5] == "4" and mixed[7] is None  # incompatible types: JSON text
    row7 = table.slice(7, 1).to_pylist()[0]
    assert row7["error"] == "engine fell over" and row7["error_kind"] == "engine" and row7["text"] is None
    assert row7["n"] is None and row7["q"] == "question id7"
    assert table.column("text").to_pylist()[0] == "out-id0"

    loaded = datasets.load_dataset("parquet", data_files=str(out.results_path), split="train")
    assert loaded["id"] == IDS and loaded[3]["num"] == 1.5 and loaded[0]["prompt_tokens"] == 3


def test_finalize_refuses_missing_rows_unless_allowed(tmp_path: Path) -> None:
    expected = _expected() + [ExpectedRow("late", make_record("late").key)]
    with CheckpointStore(tmp_path) as store:
        _fill(store)
        with pytest.raises(IncompleteResultsError, match="1 expected row") as info:
            finalize(store, tmp_path, expected, keep_columns=["q"])
        assert info.value.examples == ["late"]
        assert not (tmp_path / "results.parquet").exists()
        out = finalize(store, tmp_path, expected, keep_columns=["q", "absent"], allow_missing=True)
    assert out.missing_rows == 1 and out.error_rows == 2 and out.input_columns == ("q", "absent")
    last = pq.read_table(out.results_path).to_pylist()[-1]
    assert last["id"] == "late" and last["error_kind"] == "missing" and last["q"] is None and last["absent"] is None


def test_finalize_without_expected_rows_and_with_logprobs_and_clashing_names(tmp_path: Path) -> None:
    lp = (TokenLogprob(3, -0.5, ((3, -0.5), (4, -1.0))),)
    with CheckpointStore(tmp_path) as store:
        store.append([make_record("b", inputs={"text": "input text", "id": 9}, logprobs=lp, extra={"parsed": 1})])
        store.append([make_record("a", inputs={"text": "other"}), make_record("b", text="dup")])
        out = finalize(store, tmp_path, None, keep_columns=None)
    rows = pq.read_table(out.results_path).to_pylist()
    assert [r["id"] for r in rows] == ["b", "a"] and rows[0]["text"] == "out-b"  # first record of a key wins
    assert out.input_columns == ("input_text", "input_id") and rows[0]["input_text"] == "input text"
    assert rows[0]["logprobs"] == [{"token_id": 3, "logprob": -0.5, "top": [{"token_id": 3, "logprob": -0.5},
                                                                           {"token_id": 4, "logprob": -1.0}]}]
    # task results in ``extra`` become typed columns named by their keys, null where a row has none
    assert rows[1]["logprobs"] is None and rows[0]["parsed"] == 1 and rows[1]["parsed"] is None
    assert "extra" not in rows[0]


def test_task_results_become_typed_list_and_struct_columns(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path) as store:
        store.append([make_record("a", extra={"samples": ["x", "y"], "parsed": {"label": "pos", "score": 1}}),
                      make_record("b", extra={"samples": ["z"], "parsed": {"label": "neg", "score": 0.5}}),
                      make_record("c")])
        out = finalize(store, tmp_path, None, row_group_size=1)  # types unified across row groups
    table = pq.read_table(out.results_path)
    assert table.schema.field("samples").type == pa.list_(pa.string())
    assert table.schema.field("parsed").type == pa.struct([("label", pa.string()), ("score", pa.float64())])
    rows = table.to_pylist()
    assert rows[0]["samples"] == ["x", "y"] and rows[1]["parsed"] == {"label": "neg", "score": 0.5}
    assert rows[2]["samples"] is None


def test_finalize_of_an_empty_job(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path) as store:
        out = finalize(store, tmp_path, [], keep_columns=["q"])
    assert out.rows == 0 and pq.read_table(out.results_path).num_rows == 0


def test_openai_batch_output_files(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path) as store:
        store.append([
            make_record("r1", inputs={"url": "/v1/chat/completions"}, text="Hello!", finish_reason="stop"),
            make_record("r2", inputs={"url": "/v1/completions"}, text=" there", finish_reason="length"),
            make_record("r3", inputs={"url": "/v1/chat/completions"}, text=None, error="prompt too long",
                        error_kind="input"),
        ])
        results = finalize(store, tmp_path, None, keep_columns=["url"]).results_path
    out = write_openai_batch_output(results, tmp_path, created=1700000000)
    assert (out.ok_rows, out.error_rows) == (2, 1)
    ok = [json.loads(line) for line in out.output_path.read_text().splitlines()]
    errors = [json.loads(line) for line in out.errors_path.read_text().splitlines()]
    key1 = make_record("r1").key
    assert ok[0] == {
        "id": f"batch_req_{key1}", "custom_id": "r1",
        "response": {"status_code": 200, "request_id": f"req_{key1}", "body": {
            "id": f"chatcmpl-{key1}", "object": "chat.completion", "created": 1700000000, "model": "test-model",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "logprobs": None,
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}},
        "error": None,
    }
    assert ok[1]["response"]["body"]["object"] == "text_completion"
    assert ok[1]["response"]["body"]["choices"][0]["text"] == " there"
    assert errors == [{"id": f"batch_req_{make_record('r3').key}", "custom_id": "r3", "response": None,
                       "error": {"message": "prompt too long", "code": "input"}}]


def test_report_and_success_marker(tmp_path: Path) -> None:
    report = write_report(tmp_path, {"rows": 3, "prefill_ratio": 1.25})
    assert json.loads(report.read_text()) == {"rows": 3, "prefill_ratio": 1.25}
    assert not clear_success(tmp_path)
    marker = mark_success(tmp_path)
    assert marker.name == "_SUCCESS" and marker.read_bytes() == b""
    assert clear_success(tmp_path) and not marker.exists()
    assert not list(tmp_path.glob("*.tmp"))


def test_the_dataset_card_is_mlxbatchs_own_and_a_readme_of_the_users_is_not(tmp_path: Path) -> None:
    from mlxbatch.io import foreign_files, remove_outputs, write_dataset_card

    assert write_dataset_card(tmp_path) == tmp_path / "README.md"
    assert foreign_files(tmp_path) == []  # the card mlxbatch wrote is one of its outputs
    remove_outputs(tmp_path)  # overwrite removes it with the other outputs
    assert not (tmp_path / "README.md").exists()
    (tmp_path / "README.md").write_text("my notes\n")
    assert foreign_files(tmp_path) == ["README.md"]
    assert write_dataset_card(tmp_path) is None
    remove_outputs(tmp_path)
    assert (tmp_path / "README.md").read_text() == "my notes\n"


def test_a_card_that_cannot_be_written_is_an_output_error(tmp_path: Path, monkeypatch) -> None:
    import errno
    import os

    import mlxbatch.io.card as card
    from mlxbatch.io import OutputError, write_dataset_card

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(card, "atomic_write_bytes", full)
    with pytest.raises(OutputError, match="could not write .*README.md: No space left on device"):
        write_dataset_card(tmp_path)


def test_a_spool_shows_the_planner_its_inputs_and_finalize_reads_them_once(tmp_path: Path, monkeypatch) -> None:
    """The run's ``ExpectedSpool`` shows the results' input-column planner each chunk it writes (on the thread that
    reads the input): ``finalize`` then decodes the inputs only to write them, and writes what it writes without."""
    import mlxbatch.io.expected as expected_mod
    import mlxbatch.io.writers as writers_mod
    from mlxbatch.io import input_planner
    from mlxbatch.io.expected import ExpectedSpool

    monkeypatch.setattr(expected_mod, "_CHUNK", 4)  # several chunks: types settle across them as across row groups
    decoded: list[int] = []
    inputs_of = writers_mod.inputs_of
    monkeypatch.setattr(writers_mod, "inputs_of", lambda got, sel, part: decoded.append(1) or inputs_of(got, sel, part))

    def inputs(i: int) -> dict:
        row = {"q": f"question {i}", "n": i, "num": 1.5 if i == 9 else i, "mixed": "x" if i == 4 else i}
        return row | ({"late": [i, i + 1]} if i > 20 else {})

    with CheckpointStore(tmp_path / "store") as store:
        store.append([make_record(i, inputs=inputs(int(i[2:]))) for i in reversed(IDS)])
        written = {}
        for name, planner in [("seen", input_planner(None, {})), ("plain", None)]:
            out = tmp_path / name
            out.mkdir()
            spool = ExpectedSpool(out, planner)
            for i in IDS:
                spool.add(i, make_record(i).key, inputs(int(i[2:])))
            spool.close()
            decoded.clear()
            final = finalize(store, out, spool.columns(), keep_columns=None, row_group_size=10)
            written[name] = (pq.read_table(final.results_path), len(decoded), final.input_columns)
    seen, plain = written["seen"], written["plain"]
    assert seen[0].equals(plain[0]) and seen[2] == plain[2] == ("q", "n", "num", "mixed", "late")
    assert seen[0].schema.field("num").type == pa.float64() and seen[0].schema.field("mixed").type == pa.string()
    assert seen[0].schema.field("late").type == pa.list_(pa.int64())
    assert (seen[1], plain[1]) == (3, 6)  # 3 row groups: decoded once each, against twice without the spool's planner


def test_declared_columns_are_revived_only_where_values_are_not_as_they_are(tmp_path: Path, monkeypatch) -> None:
    """A Parquet input's own types and the task's declared columns: numbers, lists of them and plain strings are
    written as they are (no per-value ``revive``), JSON forms become their types (ISO timestamps, base64 bytes), and a string column
    holding another value writes it as JSON text."""
    import datetime as dt

    import mlxbatch.io.columns as columns_mod

    revived: list[object] = []
    revive = columns_mod.revive
    monkeypatch.setattr(columns_mod, "revive", lambda v, t: revived.append(v) or revive(v, t))
    inputs = [{"n": 7, "s": "a", "odd": "x", "at": "2024-05-01T12:30:15.123456", "blob": "aGk=", "tags": [1, 2]},
              {"n": None, "s": "b", "odd": {"k": 1}, "at": None, "blob": "AAE=", "tags": None}]
    types = {"n": pa.int32(), "s": pa.string(), "odd": pa.string(), "at": pa.timestamp("us"), "blob": pa.binary(),
             "tags": pa.list_(pa.int16())}
    with CheckpointStore(tmp_path) as store:
        store.append([make_record(f"r{i}", inputs=row, extra={"cached_tokens": 3 * i}) for i, row in enumerate(inputs)])
        out = finalize(store, tmp_path, None, input_types=types, extra_types={"cached_tokens": pa.int64()})
    table = pq.read_table(out.results_path)
    assert [table.schema.field(c).type for c in types] == list(types.values())
    assert table.schema.field("cached_tokens").type == pa.int64()
    rows = table.to_pylist()
    assert [r["n"] for r in rows] == [7, None] and [r["s"] for r in rows] == ["a", "b"]
    assert [r["odd"] for r in rows] == ["x", '{"k": 1}'] and [r["cached_tokens"] for r in rows] == [0, 3]
    assert rows[0]["at"] == dt.datetime(2024, 5, 1, 12, 30, 15, 123456) and rows[1]["at"] is None
    assert [r["blob"] for r in rows] == [b"hi", b"\x00\x01"] and [r["tags"] for r in rows] == [[1, 2], None]
    # revived: the string column with a dict in it, the timestamps and the bytes; never the numbers (nor lists of
    # them) nor "s"
    assert sorted(map(repr, revived)) == sorted(map(repr, ["x", {"k": 1}, "2024-05-01T12:30:15.123456", None,
                                                          "aGk=", "AAE="]))
