"""Length-prefixed frames over a pipe: how the run talks to its child processes (the feed's workers, the engine's
process). A frame is 8 bytes of length (little-endian) and that many bytes, a pickled message. ``FrameWriter``
writes a side's frames from a thread of its own."""

from __future__ import annotations

import pickle
import queue
import struct
import threading
from typing import Any, BinaryIO

_LEN = struct.Struct("<Q")


def frame(message: Any) -> bytes:
    """``message`` pickled, as one frame."""
    body = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


def read_frame(stream: BinaryIO) -> bytes | None:
    """One frame's body from a buffered stream, or None at the end of the stream (the other side is gone)."""
    try:
        head = stream.read(_LEN.size)
        if len(head) < _LEN.size:
            return None
        (n,) = _LEN.unpack(head)
        data = stream.read(n)
    except (OSError, ValueError):
        return None
    return data if len(data) == n else None


class _Later:
    """A message the writer's thread pickles (``FrameWriter.send_later``)."""

    __slots__ = ("message",)

    def __init__(self, message: Any) -> None:
        self.message = message


class FrameWriter:
    """Frames written to a stream by a thread of its own, in the order sent: the sender only pickles (or not even
    that: ``send_later``). A write to a pipe blocks while the pipe is full, until the other side's reader drains it
    (that reader waits for its own process's GIL): the engine's process measured 0.9 s of its stepping thread's 64 s
    in writes of finished rows (a 20,000-row job on a 2-core CPU, py-spy) before its frames went this way. Frames
    queued together go in one write.
    """

    def __init__(self, stream: BinaryIO, name: str) -> None:
        self._stream = stream
        self._queue: queue.SimpleQueue[bytes | _Later | None] = queue.SimpleQueue()
        # what stopped the writes: the other side gone (OSError), or a message ``send_later`` took that did not
        # pickle; frames after it are dropped
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._write, name=name, daemon=True)
        self._thread.start()

    def send(self, message: Any) -> None:
        """Queue ``message`` as a frame, pickled now; raises the error that stopped the writes."""
        if self.error is not None:
            raise self.error
        self._queue.put(frame(message))

    def send_later(self, message: Any) -> None:
        """Queue ``message``, pickled by the writer's thread (the sender's time is the one that counts: the engine
        process's stepping thread spent 0.9 s of an H100's 100k-row job pickling finished rows). Nothing in it may
        change once sent. Raises the error that stopped the writes."""
        if self.error is not None:
            raise self.error
        self._queue.put(_Later(message))

    def close(self, timeout: float | None = None) -> bool:
        """Write what is queued, then stop; False when that took longer than ``timeout`` seconds."""
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _write(self) -> None:
        end = False
        while not end:
            frames: list[bytes] = []
            item = self._queue.get()
            while True:  # every frame queued meanwhile, in one write
                if item is None:
                    end = True
                    break
                if isinstance(item, _Later):
                    try:
                        item = frame(item.message)
                    except Exception as exc:  # noqa: BLE001 - raised to the sender by its next send
                        self.error = exc  # (the frames before it are written, none after)
                        end = True
                        break
                frames.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if not frames:
                continue
            try:
                self._stream.write(b"".join(frames))
                self._stream.flush()
            except (OSError, ValueError) as exc:  # (ValueError: the stream was closed)
                self.error = exc if isinstance(exc, OSError) else BrokenPipeError(str(exc))
                return
