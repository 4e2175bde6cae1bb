"""Memory figures of the bench on Linux and macOS: /proc when it is there, ``ru_maxrss`` in the right unit when not.

macOS has no /proc and reports ``ru_maxrss`` in bytes (Linux: KiB): the platform and the /proc files are injected.
"""

from __future__ import annotations

import json
import os
import resource
import sys

import pytest

from mlxbatch.bench import memory
from mlxbatch.bench.stream_child import stream_child


def raw_maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_ru_maxrss_unit_follows_the_platform():
    assert memory.ru_maxrss_bytes("darwin", raw=5000) == 5000
    assert memory.ru_maxrss_bytes("linux", raw=5000) == 5000 * 1024
    assert memory.ru_maxrss_bytes("freebsd14", raw=3) == 3 * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="compares with Linux's /proc")
def test_on_linux_ru_maxrss_in_bytes_agrees_with_vmhwm():
    hwm = memory.status_kb("VmHWM") * 1024
    assert memory.peak_rss() == hwm
    assert memory.ru_maxrss_bytes() >= 0.9 * hwm  # the same high-water mark (it may include the parent's)
    assert 0 < memory.current_rss() <= hwm * 1.1


def test_without_proc_the_figures_come_from_getrusage(tmp_path):
    missing = str(tmp_path / "no-proc")
    assert memory.status_kb("VmHWM", missing) is None
    for platform, unit in (("darwin", 1), ("linux", 1024)):
        before = raw_maxrss()
        cur = memory.current_rss(platform, statm=missing)
        peak = memory.peak_rss(platform, status=missing)
        after = raw_maxrss()
        assert before * unit <= cur <= after * unit
        assert before * unit <= peak <= after * unit


def test_proc_files_are_parsed(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t    2048 kB\nRssAnon:\t 512 kB\n")
    statm = tmp_path / "statm"
    statm.write_text("9000 300 20 1 0 700 0\n")
    assert memory.peak_rss("linux", status=str(status)) == 2048 * 1024
    assert memory.status_kb("RssAnon", str(status)) == 512
    assert memory.status_kb("RssFile", str(status)) is None
    assert memory.current_rss("linux", statm=str(statm)) == 300 * os.sysconf("SC_PAGE_SIZE")
    statm.write_text("garbage")
    assert memory.current_rss("darwin", statm=str(statm)) > 0  # unreadable: falls back, does not raise


def _rows(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"r{i}", "text": f"a few words number {i}"}) + "\n")
    return path


def test_streaming_child_runs_without_proc_as_on_macos(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "PLATFORM", "darwin")
    monkeypatch.setattr(memory, "STATUS", str(tmp_path / "no-status"))
    monkeypatch.setattr(memory, "STATM", str(tmp_path / "no-statm"))
    before = raw_maxrss()
    r = stream_child(str(_rows(tmp_path / "in.jsonl", 50)), str(tmp_path / "out"), every=20, track_ids=True)
    after = raw_maxrss()
    assert r["rows"] == 50 and r["shards"] == 3
    assert r["anon_peak"] is None and r["rss_file_end"] is None  # no /proc: unknown, not 0
    assert before <= r["maxrss"] <= after  # ru_maxrss taken as bytes, as macOS reports it
    assert before <= r["ru_maxrss"] <= after


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_streaming_child_on_linux_reads_proc(tmp_path):
    r = stream_child(str(_rows(tmp_path / "in.jsonl", 30)), str(tmp_path / "out"), every=10, track_ids=False)
    assert r["rows"] == 30 and r["shards"] == 3
    # read from /proc: RssAnon sampled while it ran, VmHWM at its end. Not ordered: the kernel updates the mark VmHWM
    # reads (``hiwater_rss``) only now and then (an unmap, an exit) and reports max(mark, RSS now), so a peak the
    # sampler saw can be past a later VmHWM (seen once in a full run under load)
    assert r["anon_peak"] > 0 and r["maxrss"] > 0 and r["rss_file_end"] > 0
    assert r["anon_peak"] < 4 * max(r["maxrss"], memory.peak_rss())


def test_constraints_bench_reads_rss_without_proc(tmp_path, monkeypatch):
    from mlxbatch.bench import constraints

    monkeypatch.setattr(memory, "PLATFORM", "darwin")
    monkeypatch.setattr(memory, "STATUS", str(tmp_path / "no-status"))
    monkeypatch.setattr(memory, "STATM", str(tmp_path / "no-statm"))
    before = raw_maxrss() / (1 << 20)
    current, peak = constraints.rss_mb()  # read /proc/self/status unguarded before: FileNotFoundError on macOS
    # (the process's peak may grow between two reads: another thread allocates)
    assert current == peak and before <= peak <= raw_maxrss() / (1 << 20)
