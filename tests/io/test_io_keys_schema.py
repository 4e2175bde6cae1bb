"""Result keys, canonical parameters, duplicate-id tracking, the shard schema round trip and the layer rule."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st
from io_helpers import make_record

from mlxbatch.io import DuplicateIdTracker, ResultRecord, canonical_params, from_arrow, result_key, to_arrow
from mlxbatch.io.schema import SHARD_SCHEMA
from mlxbatch.types import SamplingParams, TokenLogprob


def test_result_key_is_stable_and_sensitive_to_every_part() -> None:
    base = ("row1", "prompt", "model@rev", '{"t":0}', 7)
    key = result_key(*base)
    assert key == result_key(*base) and len(key) == 32 and int(key, 16) >= 0
    for i, changed in enumerate(["row2", "prompt!", "model@rev2", '{"t":1}', 8]):
        variant = list(base)
        variant[i] = changed
        assert result_key(*variant) != key
    assert result_key("a", "bc", "m", "{}", None) != result_key("ab", "c", "m", "{}", None)
    assert result_key("a", "b", "m", "{}", None) != result_key("a", "b", "m", "{}", 0)


def test_canonical_params_orders_keys() -> None:
    assert canonical_params({"b": 1, "a": [1, 2]}) == '{"a":[1,2],"b":1}'
    params = SamplingParams(temperature=0.0, stop=("x",), seed=3)
    assert canonical_params(params) == canonical_params(SamplingParams(seed=3, stop="x", temperature=0))
    assert canonical_params(params) != canonical_params(SamplingParams(temperature=0.0, stop=("x",), seed=4))


def test_duplicate_id_tracker() -> None:
    tracker = DuplicateIdTracker(max_examples=1)
    assert [tracker.add(i) for i in ["a", "b", "a", "c", "b", "a"]] == [True, True, False, True, False, False]
    assert tracker.report() == {"duplicate_rows": 3, "examples": ["a"]}


def test_schema_round_trip_with_non_json_inputs() -> None:
    record = make_record("x", inputs={"when": dt.date(2024, 1, 2), "blob": b"\x00\x01", "tags": ("a", "b")},
                         logprobs=(TokenLogprob(1, -0.1),), extra={"n": 2})
    table = to_arrow([record, make_record("y")])
    assert table.schema.equals(SHARD_SCHEMA) and table.num_rows == 2
    back = list(from_arrow(table))
    assert back[1] == make_record("y")
    assert back[0].inputs == {"when": "2024-01-02", "blob": "AAE=", "tags": ["a", "b"]}
    assert back[0].logprobs == (TokenLogprob(1, -0.1),) and back[0].extra == {"n": 2}


@given(text=st.text(), error=st.one_of(st.none(), st.text()), tokens=st.integers(0, 2**40),
       latency=st.one_of(st.none(), st.floats(allow_nan=False)),
       inputs=st.dictionaries(st.text(), st.one_of(st.none(), st.booleans(), st.integers(-2**62, 2**62), st.text())))
def test_schema_round_trip_property(text: str, error: str | None, tokens: int, latency: float | None,
                                    inputs: dict) -> None:
    record = ResultRecord(row_id="r", key="k", inputs=inputs, text=text, error=error, prompt_tokens=tokens,
                          latency_s=latency)
    assert list(from_arrow(to_arrow([record]))) == [record]


def test_io_layer_imports_neither_mlx_nor_engine_nor_job() -> None:
    code = ("import sys, mlxbatch.io; bad = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm') "
            "or m.startswith(('mlxbatch.engine', 'mlxbatch.job'))]; print(bad); sys.exit(bool(bad))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_ids_never_make_a_real_row_a_duplicate() -> None:
    t = DuplicateIdTracker()
    assert t.add("in.jsonl:3")  # a real row whose id looks generated
    assert t.generated("in.jsonl:3") == "in.jsonl:3#2"  # the reader's id for line 3 steps aside
    assert t.generated("in.jsonl:4") == "in.jsonl:4"
    assert t.generated("a:1") == "a:1" and t.generated("a:1") == "a:1#2"  # two files with one stem
    assert not t.add("in.jsonl:3") and t.duplicates == 1  # real ids still are


def test_an_id_is_never_given_twice() -> None:
    """A real id equal to one given earlier to an unreadable row is taken: the results would hold two rows with
    one id. The row is a duplicate, and ``generated`` gives it an id of its own."""
    t = DuplicateIdTracker()
    assert t.generated("in.jsonl:4") == "in.jsonl:4"
    assert not t.add("in.jsonl:4") and t.is_generated("in.jsonl:4") and t.duplicates == 1
    assert t.generated("in.jsonl:4") == "in.jsonl:4#2"
    assert t.add("x") and not t.add("x") and not t.is_generated("x") and t.generated("x") == "x#2"
    assert not t.add("x#2")  # a real id equal to one given to a duplicate is taken too
