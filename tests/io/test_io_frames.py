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


def _read_all(reader) -> list:
    out = []
    while (data := read_frame(reader)) is not None:
        out.append(pickle.loads(data))
    return out


def test_messages_pickled_by_the_writer_s_thread_arrive_in_order_with_the_others():
    r, w = os.pipe()
    reader, stream = os.fdopen(r, "rb"), os.fdopen(w, "wb")
    writer = FrameWriter(stream, "test-writer")
    for i in range(50):
        (writer.send_later if i % 3 else writer.send)(("n", i, list(range(i))))
    got: list = []
    t = threading.Thread(target=lambda: got.extend(_read_all(reader)))
    t.start()
    assert writer.close(timeout=30)
    stream.close()
    t.join(timeout=30)
    assert got == [("n", i, list(range(i))) for i in range(50)]


def test_a_message_that_does_not_pickle_on_the_writer_s_thread_fails_the_next_send():
    """What came before it is written; it and what follows are not; the sender hears of it at its next send."""
    r, w = os.pipe()
    reader, stream = os.fdopen(r, "rb"), os.fdopen(w, "wb")
    writer = FrameWriter(stream, "test-writer")
    writer.send(("first", 1))
    writer.send_later(("bad", lambda: None))  # (a lambda does not pickle)
    writer.send_later(("after", 2))
    assert writer.close(timeout=10)
    stream.close()
    assert _read_all(reader) == [("first", 1)]
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        writer.send(("third", 3))
