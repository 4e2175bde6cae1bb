"""Frames between the run and its child processes: ``FrameWriter`` writes them from a thread of its own, in order,
and the sender does not wait for a reader that drains the pipe late."""

from __future__ import annotations

import os
import pickle
import threading
import time

import pytest

from mlxbatch.io.frames import FrameWriter, read_frame


def test_frames_sent_to_a_full_pipe_do_not_wait_for_its_reader_and_arrive_in_order():
    r, w = os.pipe()
    reader, stream = os.fdopen(r, "rb"), os.fdopen(w, "wb")
    writer = FrameWriter(stream, "test-writer")
    big = bytes(200_000)  # three times a Linux pipe's buffer: a plain write would block until the reader reads
    t0 = time.monotonic()
    for i in range(20):
        writer.send((i, big))
    sent_s = time.monotonic() - t0
    got: list[int] = []

    def read() -> None:
        while (data := read_frame(reader)) is not None:
            i, body = pickle.loads(data)
            assert body == big
            got.append(i)

    time.sleep(0.2)  # nobody reads yet: the writer's thread waits, not the sender
    assert sent_s < 0.5 and not got
    t = threading.Thread(target=read)
    t.start()
    assert writer.close(timeout=30)
    stream.close()
    t.join(timeout=30)
    assert got == list(range(20))


def test_a_writer_whose_reader_is_gone_raises_on_the_next_send():
    r, w = os.pipe()
    stream = os.fdopen(w, "wb")
    os.close(r)
    writer = FrameWriter(stream, "test-writer")
    writer.send(("first", 1))  # queued: the write fails on the writer's thread
    assert writer.close(timeout=10)
    assert isinstance(writer.error, BrokenPipeError)
    with pytest.raises(BrokenPipeError):
        writer.send(("second", 2))
