"""JSONL and OpenAI batch readers: error rows name file and line, reading goes on; globs; row counts; memory."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
from io_helpers import write_jsonl

from mlxbatch.io import InputError, InputFormat, InputSpec, count_rows, open_reader


def test_jsonl_bad_lines_become_error_rows_and_reading_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(
        b'{"id": "a", "q": "one"}\n'   # 1
        b"\n"                          # 2 blank: skipped
        b"{not json}\n"                # 3
        b"[1, 2]\n"                    # 4 not an object
        b'{"id": "b", "q": "\xff\xfe"}\n'  # 5 invalid UTF-8
        b"   \t \n"                    # 6 blank
        b'{"q": "no id"}\n'            # 7 missing id
        b'{"id": 7, "q": "last"}'      # 8 no trailing newline, integer id
    )
    rows = list(open_reader(InputSpec(str(path), id_column="id")))
    assert [r.position for r in rows] == [1, 3, 4, 5, 7, 8]
    assert rows[0].ok and rows[0].row_id == "a" and rows[0].fields == {"id": "a", "q": "one"}
    assert rows[1].error.startswith(f"{path}:3: invalid JSON:") and rows[1].row_id == "data.jsonl:3"
    assert rows[2].error == f"{path}:4: expected a JSON object, got list"
    assert rows[3].error.startswith(f"{path}:5: invalid UTF-8")
    assert rows[4].error == f"{path}:7: id column 'id' is missing" and rows[4].row_id == "data.jsonl:7"
    assert rows[5].ok and rows[5].row_id == "7" and rows[5].source == str(path)
    assert all(r.request is None for r in rows)


def test_a_json_object_with_a_key_given_twice_is_an_error_row(tmp_path: Path) -> None:
    """JSON keeps the last of two values of one key: the row would run on a value nobody chose."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "a", "text": "one", "text": "two"}\n{"id": "b", "meta": {"x": 1, "x": 2}}\n'
                    '{"id": "c", "text": "fine"}\n')
    rows = list(open_reader(InputSpec(path, id_column="id")))
    assert rows[0].error == f"{path}:1: the key 'text' is given twice in one object (JSON would keep the last)"
    assert rows[1].error == f"{path}:2: the key 'x' is given twice in one object (JSON would keep the last)"
    assert [r.row_id for r in rows] == ["d.jsonl:1", "d.jsonl:2", "c"] and rows[2].ok


def test_jsonl_without_id_column_and_column_selection(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "x.jsonl", [{"a": 1, "b": 2}, {"a": 3}])
    rows = list(open_reader(InputSpec(path, columns=["b"])))
    assert [r.row_id for r in rows] == ["x:1", "x:2"]
    assert [r.fields for r in rows] == [{"b": 2}, {"b": None}]


def test_jsonl_bom_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n')
    (row,) = open_reader(InputSpec(path))
    assert row.ok and row.fields == {"a": 1}


def test_glob_reads_sorted_files_one_after_another(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "b.jsonl", [{"id": "b1"}, {"id": "b2"}])
    write_jsonl(tmp_path / "a.jsonl", [{"id": "a1"}])
    (tmp_path / "c.txt").write_text("ignored")
    spec = InputSpec(str(tmp_path / "*.jsonl"), id_column="id")
    rows = list(open_reader(spec))
    assert [r.row_id for r in rows] == ["a1", "b1", "b2"]
    assert [Path(r.source).name for r in rows] == ["a.jsonl", "b.jsonl", "b.jsonl"]
    assert count_rows(spec) == 3
    assert [r.row_id for r in open_reader(InputSpec(tmp_path, format="jsonl", id_column="id"))] == ["a1", "b1", "b2"]


APPLE_DOUBLE = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(64)  # a resource fork: not text


@pytest.mark.parametrize("fmt", ["jsonl", "auto"])
def test_hidden_files_in_an_input_folder_or_glob_are_not_input(tmp_path: Path, fmt: str) -> None:
    """Finder writes AppleDouble ``._name`` files next to every file it copies to an exFAT or network drive (and
    ``.DS_Store``): they are not rows, as the ``hf`` folder reader already says."""
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", [{"id": "a1"}])
    write_jsonl(data / "b.jsonl", [{"id": "b1"}])
    for hidden in ("._a.jsonl", "._b.jsonl", ".DS_Store"):
        (data / hidden).write_bytes(APPLE_DOUBLE)
    write_jsonl(data / ".draft.jsonl", [{"id": "draft"}])
    folder = InputSpec(str(data), format="jsonl", id_column="id")
    pattern = InputSpec(str(data / "*.jsonl"), format=fmt, id_column="id")
    for spec in (folder, pattern):
        rows = list(open_reader(spec))
        assert [(r.row_id, r.error) for r in rows] == [("a1", None), ("b1", None)]
        assert count_rows(spec) == 2
    only_hidden = tmp_path / "only"
    only_hidden.mkdir()
    (only_hidden / "._a.jsonl").write_bytes(APPLE_DOUBLE)
    with pytest.raises(InputError, match="holds no jsonl files"):
        open_reader(InputSpec(str(only_hidden), format="jsonl"))
    (row,) = open_reader(InputSpec(str(data / ".draft.jsonl"), id_column="id"))  # named: read
    assert row.row_id == "draft"


def test_count_rows_counts_newlines(tmp_path: Path) -> None:
    path = tmp_path / "n.jsonl"
    path.write_bytes(b'{"a":1}\n{"a":2}\n{"a":3}')
    assert count_rows(InputSpec(path)) == 3
    path.write_bytes(b"")
    assert count_rows(InputSpec(path)) == 0


def test_missing_input_and_bad_spec_raise_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not found"):
        open_reader(InputSpec(tmp_path / "nope.jsonl"))
    with pytest.raises(InputError, match="no input matches"):
        open_reader(InputSpec(str(tmp_path / "*.jsonl")))
    with pytest.raises(InputError, match="unknown input format"):
        InputSpec("x", format="xml")
    (tmp_path / "arr.json").write_text('  [{"a": 1}]')
    with pytest.raises(InputError, match="JSON array document"):
        open_reader(InputSpec(tmp_path / "arr.json"))
    (tmp_path / "x.csv").write_text("a\n1\n")
    with pytest.raises(InputError, match="cannot tell the input format"):
        open_reader(InputSpec(tmp_path / "x.csv"))


def _batch_line(custom_id: str | None, body: object, url: str = "/v1/chat/completions") -> dict:
    line: dict = {"method": "POST", "url": url, "body": body}
    if custom_id is not None:
        line["custom_id"] = custom_id
    return line


def test_openai_batch_rows_and_error_rows(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path / "batch.jsonl", [
        _batch_line("r1", {"model": "m", "messages": messages, "max_tokens": 5, "temperature": 0}),
        _batch_line("r2", {"model": "m", "prompt": "once upon"}, url="/v1/completions"),
        _batch_line(None, {"model": "m", "messages": messages}),
        _batch_line("r4", None),
        _batch_line("r5", {"model": "m", "input": "x"}, url="/v1/embeddings"),
        _batch_line("r6", {"model": "m"}),
    ])
    spec = InputSpec(path)
    rows = list(open_reader(spec))
    assert count_rows(spec) == 6
    r1, r2, r3, r4, r5, r6 = rows
    assert r1.ok and r1.row_id == "r1" and r1.position == 1
    assert r1.request == {"model": "m", "messages": messages, "max_tokens": 5, "temperature": 0}
    assert r1.fields == {"custom_id": "r1", "url": "/v1/chat/completions", "model": "m", "messages": messages,
                         "max_tokens": 5, "temperature": 0}
    assert r2.ok and r2.fields["prompt"] == "once upon" and r2.fields["url"] == "/v1/completions"
    assert r3.error == f"{path}:3: invalid batch request: missing or empty 'custom_id'" and r3.row_id == "batch.jsonl:3"
    assert r4.error == f"{path}:4: invalid batch request: missing 'body' object" and r4.row_id == "r4"
    assert "unsupported url '/v1/embeddings'" in r5.error
    assert "body.messages must be a list" in r6.error
    assert all(r.request is None for r in (r3, r4, r5, r6))


def test_openai_content_parts_text_and_images_only(tmp_path: Path) -> None:
    """image_url parts are the request's images (a file:// URL as its path); another part type (audio) is a line
    error naming the part, not a render error later."""
    from mlxbatch.io.jsonl import request_images

    def parts(*ps):
        return {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": list(ps)}]}

    text = {"type": "text", "text": "What is it?"}
    path = write_jsonl(tmp_path / "batch.jsonl", [
        _batch_line("img", parts(text, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                 {"type": "image_url", "image_url": {"url": "file:///pics/a%20b.png"}})),
        _batch_line("audio", parts(text, {"type": "input_audio", "input_audio": {"data": "..."}})),
        _batch_line("no-url", parts(text, {"type": "image_url", "image_url": {}})),
    ])
    img, audio, no_url = open_reader(InputSpec(path))
    assert img.ok and request_images(img.request) == ["data:image/png;base64,AA==", "/pics/a b.png"]
    assert audio.error == (f"{path}:2: invalid batch request: body.messages[1].content[1]: unsupported content part "
                           "type 'input_audio' (supported: text, image_url)") and audio.row_id == "audio"
    assert "body.messages[1].content[1]: an image_url part needs" in no_url.error


def test_openai_batch_format_can_be_forced_and_keeps_malformed_lines(tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    path.write_text('{"nope\n' + json.dumps(_batch_line("x", {"prompt": "p"}, url="/v1/completions")) + "\n")
    rows = list(open_reader(InputSpec(path, format=InputFormat.OPENAI_BATCH)))
    assert rows[0].error.startswith(f"{path}:1: invalid JSON") and rows[1].row_id == "x" and rows[1].ok


def test_streaming_50k_lines_keeps_memory_small(tmp_path: Path) -> None:
    """50k lines (6.6 MB, 3x the bound; held as parsed dicts they take 25 MB): 200k took 10 s under tracemalloc."""
    path = tmp_path / "big.jsonl"
    line = '{"id": "%d", "prompt": "%s"}\n'
    with open(path, "w") as f:
        f.writelines(line % (i, "x" * 100) for i in range(50_000))
    assert path.stat().st_size > 6_000_000
    tracemalloc.start()
    try:
        count = 0
        for row in open_reader(InputSpec(path, id_column="id")):
            count += row.ok
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 50_000
    assert peak < 2_000_000, f"peak traced memory {peak} bytes: the reader holds rows"
