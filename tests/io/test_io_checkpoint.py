"""CheckpointStore: durable appends, reopen, crash leftovers (tmp, unlisted shard, truncated shard), metadata."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from io_helpers import make_record

from mlxbatch.io import CheckpointError, CheckpointStore
from mlxbatch.io.manifest import MANIFEST_NAME, ShardInfo
from mlxbatch.types import FinishReason, TokenLogprob


def _manifest(out: Path) -> dict:
    return json.loads((out / MANIFEST_NAME).read_text())


def test_append_reopen_done_keys_and_records(tmp_path: Path) -> None:
    lp = (TokenLogprob(5, -0.25, ((5, -0.25), (9, -2.0))), TokenLogprob(7, -1.5))
    first = [make_record("a", logprobs=lp, finish_reason=FinishReason.LENGTH), make_record("b")]
    second = [make_record("c", inputs={"q": "x", "n": 1}, extra={"samples": ["s1", "s2"]}),
              make_record("d", text=None, error="boom", error_kind="engine")]
    with CheckpointStore(tmp_path) as store:
        p1 = store.append(first)
        p2 = store.append(second)
        assert p1.name == "shard-000001.arrow" and p2.name == "shard-000002.arrow"
    with CheckpointStore(tmp_path) as store:
        assert store.done_keys() == {r.key for r in first + second}
        assert list(store.iter_records()) == first + second
        assert store.num_records == 4 and store.recovery.adopted == ()
        assert store.append([make_record("e")]).name == "shard-000003.arrow"
    manifest = _manifest(tmp_path)
    assert [s["rows"] for s in manifest["shards"]] == [2, 2, 1]
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"])
    with CheckpointStore(tmp_path) as store:
        assert next(store.iter_records()).logprobs == lp


def test_record_finish_reason_enum_is_stored_as_its_value() -> None:
    assert make_record("a", finish_reason=FinishReason.STOP).finish_reason == "stop"


def test_duplicate_key_keeps_the_first_record(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path) as store:
        store.append([make_record("a", text="first")])
        store.append([make_record("a", text="second")])
        records = list(store.iter_records())
    assert [r.text for r in records] == ["first"]


def test_store_is_locked_while_open(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointError, match="in use by another mlxbatch run"):
        CheckpointStore(tmp_path)
    store.close()
    CheckpointStore(tmp_path).close()
    with pytest.raises(CheckpointError, match="closed"):
        store.append([make_record("a")])
    with CheckpointStore(tmp_path / "x") as other, pytest.raises(ValueError):
        other.append([])


def test_truncated_shard_is_moved_aside_and_its_rows_redone(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path) as store:
        store.append([make_record("a")])
        bad = store.append([make_record("b"), make_record("c")])
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with CheckpointStore(tmp_path) as store:
        assert store.recovery.corrupt == ("shard-000002.arrow",)
        assert store.done_keys() == {make_record("a").key}
        assert not bad.exists() and (tmp_path / "shards" / "corrupt" / bad.name).exists()
        # The sequence number of the casualty is never reused.
        assert store.append([make_record("b")]).name == "shard-000003.arrow"
    assert [s["name"] for s in _manifest(tmp_path)["shards"]] == ["shard-000001.arrow", "shard-000003.arrow"]


def test_truncated_unlisted_shard_is_moved_aside(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path) as store:
        path = store.append([make_record("a")])
    data = path.read_bytes()
    path.write_bytes(data[:-6])  # only the footer's magic is gone
    (tmp_path / MANIFEST_NAME).unlink()  # as if the crash came before the manifest listed it
    with CheckpointStore(tmp_path) as store:
        assert store.recovery.corrupt == (path.name,) and store.done_keys() == set()


def test_leftover_tmp_is_ignored_and_removed(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path) as store:
        store.append([make_record("a")])
    leftover = tmp_path / "shards" / "shard-000002.arrow.tmp"
    leftover.write_bytes(b"half a shard")
    (tmp_path / (MANIFEST_NAME + ".tmp")).write_text("{")
    with CheckpointStore(tmp_path) as store:
        assert set(store.recovery.removed_tmp) == {leftover.name, MANIFEST_NAME + ".tmp"}
        assert not leftover.exists()
        assert store.done_keys() == {make_record("a").key}
        assert store.append([make_record("b")]).name == "shard-000002.arrow"


def test_shard_missing_from_manifest_is_adopted(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path) as store:
        store.append([make_record("a")])
        before = (tmp_path / MANIFEST_NAME).read_bytes()
        store.append([make_record("b")])
    (tmp_path / MANIFEST_NAME).write_bytes(before)  # crash between the rename and the manifest update
    with CheckpointStore(tmp_path) as store:
        assert store.recovery.adopted == ("shard-000002.arrow",)
        assert store.done_keys() == {make_record("a").key, make_record("b").key}
        assert [s.name for s in store.shards] == ["shard-000001.arrow", "shard-000002.arrow"]
    assert len(_manifest(tmp_path)["shards"]) == 2


def test_missing_listed_shard_is_dropped(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path) as store:
        store.append([make_record("a")])
        path = store.append([make_record("b")])
    path.unlink()
    with CheckpointStore(tmp_path) as store:
        assert store.recovery.missing == (path.name,)
        assert store.done_keys() == {make_record("a").key}


def test_verify_detects_corrupted_bytes(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path) as store:
        path = store.append([make_record("a", text="hello world")])
        data = bytearray(path.read_bytes())
        i = data.find(b"hello world")
        data[i] = ord("j")
        path.write_bytes(bytes(data))  # same size, still opens: only the hash can tell
        assert store.verify() == (path.name,)
        assert store.done_keys() == set()


def test_the_manifest_lists_every_field_of_each_shard(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path) as store:
        store.append([make_record("a")])
        store.append([make_record("b"), make_record("c")])
    entries = json.loads((tmp_path / MANIFEST_NAME).read_text())["shards"]
    shards = [ShardInfo(**e) for e in entries]  # (a field left out of ``entry`` fails here)
    assert entries == [dataclasses.asdict(s) for s in shards] and [s.rows for s in shards] == [1, 2]
    assert all(len(s.sha256) == 64 and s.bytes > 0 for s in shards)


def test_meta_round_trips_and_survives_appends(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path) as store:
        store.set_meta("job_hash", "abc")
        store.set_meta("plan", {"order": [3, 1, 2]})
        store.append([make_record("a")])
        with pytest.raises(TypeError):
            store.set_meta("bad", object())
    with CheckpointStore(tmp_path) as store:
        assert store.get_meta("job_hash") == "abc" and store.get_meta("plan") == {"order": [3, 1, 2]}
        assert store.get_meta("nope", 5) == 5 and store.meta == {"job_hash": "abc", "plan": {"order": [3, 1, 2]}}


def test_foreign_or_future_manifest_is_refused(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"format": "mlxbatch-checkpoint", "version": 99}))
    with pytest.raises(CheckpointError, match="version"):
        CheckpointStore(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"shards": []}))
    with pytest.raises(CheckpointError, match="not an mlxbatch checkpoint manifest"):
        CheckpointStore(tmp_path)


def _flip(path: Path, needle: bytes, to: bytes) -> None:
    data = path.read_bytes()
    assert needle in data
    path.write_bytes(data.replace(needle, to, 1))  # same size, still a readable Arrow file


def test_a_shard_that_no_longer_matches_its_checksum_is_set_aside_when_the_store_opens(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path) as store:
        store.append([make_record("a", text="fine")])
        bad = store.append([make_record("b", text="hello world")])
    _flip(bad, b"hello world", b"jello world")
    with CheckpointStore(tmp_path) as store:
        assert store.recovery.corrupt == (bad.name,)
        assert store.done_keys() == {make_record("a").key}  # b is redone, never published as it is
        assert (tmp_path / "shards" / "corrupt" / bad.name).exists()
        assert store.append([make_record("b")]).name == "shard-000003.arrow"  # the casualty's number stays used


def test_a_zeroed_checksum_in_the_manifest_is_not_trusted(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path) as store:
        path = store.append([make_record("a")])
    manifest = _manifest(tmp_path)
    manifest["shards"][0]["sha256"] = "0" * 64
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(manifest))
    with CheckpointStore(tmp_path) as store:
        assert store.recovery.corrupt == (path.name,) and store.done_keys() == set()


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbled", "no shards key"])
def test_a_broken_manifest_is_rebuilt_from_the_shards(tmp_path: Path, damage: str) -> None:
    with CheckpointStore(tmp_path) as store:
        store.append([make_record("a")])
        store.append([make_record("b"), make_record("c")])
    text = (tmp_path / MANIFEST_NAME).read_text()
    broken = {"empty": "", "truncated": text[: len(text) // 2], "garbled": "\x00\x01{{",
              "no shards key": json.dumps({"format": "mlxbatch-checkpoint", "version": 1})}[damage]
    (tmp_path / MANIFEST_NAME).write_text(broken)
    with CheckpointStore(tmp_path) as store:
        assert store.recovery.adopted == ("shard-000001.arrow", "shard-000002.arrow")
        assert store.done_keys() == {make_record(k).key for k in "abc"}
        assert store.append([make_record("d")]).name == "shard-000003.arrow"
    assert len(_manifest(tmp_path)["shards"]) == 3
    assert list((tmp_path / "shards" / "corrupt").glob(MANIFEST_NAME + ".*"))  # the broken one is kept aside


def test_the_lock_names_the_run_that_holds_it(tmp_path: Path) -> None:
    import os

    with CheckpointStore(tmp_path), pytest.raises(CheckpointError, match=f"another mlxbatch run \\(pid {os.getpid()}\\)"):
        CheckpointStore(tmp_path)


def test_each_shard_entry_is_encoded_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest is rewritten with every shard: encoding every entry each time grew a run's manifest writes with
    the square of its shards (16 ms of the checkpoint thread's CPU a write at 5,000 shards, 1.3 ms encoding each once)."""
    encoded: list[str] = []
    entry = ShardInfo.entry
    monkeypatch.setattr(ShardInfo, "entry", lambda self: encoded.append(self.name) or entry(self))
    with CheckpointStore(tmp_path) as store:
        for k in range(6):
            store.append([make_record(f"r{k}")])
        store.set_meta("plan", {"windows": 2})
    assert sorted(encoded) == sorted(set(encoded)) and len(encoded) == 6
    manifest = _manifest(tmp_path)
    assert [s["rows"] for s in manifest["shards"]] == [1] * 6 and manifest["meta"] == {"plan": {"windows": 2}}
