"""One Ctrl-C stops the test suite (`tests/ctrl_c.py`), even while a test's job run has its own SIGINT handler."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from jobkit import texts, write_job, write_jsonl

TESTS = Path(__file__).parent.parent  # tests/, where ctrl_c.py is


def test_one_sigint_during_a_job_run_stops_the_whole_suite(tmp_path, tiny_model_path):
    data = write_jsonl(tmp_path / "in.jsonl", texts(400))
    job = write_job(tmp_path, tiny_model_path, data, tmp_path / "out", sampling={"max_tokens": 48},
                    checkpoint={"every_rows": 8, "every_seconds": 600})
    after = tmp_path / "the-next-test-ran"
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(f"""
        from pathlib import Path
        import mlxbatch

        def test_a_job_run():
            mlxbatch.run_job({str(job)!r})

        def test_the_next_one():
            Path({str(after)!r}).touch()
    """))
    # the suite's own plugin, in a pytest of its own (its tests/ on the path), run on the probe file
    child = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "ctrl_c", "-p", "no:cacheprovider", "test_probe.py"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])})
    try:
        deadline = time.monotonic() + 300
        while not list((tmp_path / "out" / "shards").glob("shard-*.arrow")):  # the job's handler is in charge
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()[0][-3000:]
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)  # once, as a Ctrl-C would
        out = child.communicate(timeout=300)[0]
    finally:
        child.kill()
    assert child.returncode == 2, out[-3000:]  # pytest's "interrupted"
    assert "Ctrl-C (SIGINT) during test_probe.py::test_a_job_run" in out, out[-3000:]
    assert "JobInterrupted" in out and not after.exists(), out[-3000:]
