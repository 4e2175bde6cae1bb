"""Length-prefixed frames over a pipe: how the run talks to its child processes (the feed's workers, the engine's
process). A frame is 8 bytes of length (little-endian) and that many bytes, a pickled message."""

from __future__ import annotations

import pickle
import struct
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
