"""Images of input rows: references in a row's ``images`` column, byte digests, full decoding and verification.

Owns turning a column value into image references (a local path, relative to the input file's folder; raw bytes
from Parquet; Hugging Face's ``{"bytes", "path"}`` image struct; a ``data:image/...;base64,`` URL; or a list of
these), the digest of each image's bytes (cheap: it goes into the row's result key on every pass), and loading an
image for the engine: decoded completely (a truncated file fails here, not halfway through a batch), converted to
RGB, with a content hash of its decoded pixels.

Why the pixels and not the bytes for the content hash: the model sees pixels, so the same picture stored as a file
and as Parquet bytes, or re-saved with other compression or metadata, shares its vision features and its prefix
KV; hashing a decoded 1-megapixel image costs about a millisecond. Every problem (missing, unreadable, not an image,
truncated or corrupt, too large, remote URL) is an ``ImageError`` naming the file. Pure Python + Pillow: no mlx.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxbatch.errors import MlxbatchError
from mlxbatch.types import ImageInput

IMAGES_COLUMN = "images"


class ImageError(MlxbatchError):
    """An image that cannot be used; the message names the image (file, or bytes of which row)."""


@dataclass(frozen=True)
class ImageRef:
    """Where one image of a row comes from: a local file or bytes carried by the row."""

    source: str  # what messages name: the path as resolved, or "images[i] (N bytes)"
    path: Path | None = None
    data: bytes | None = None


def _one_ref(value: Any, base_dir: Path, i: int) -> ImageRef:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ImageRef(f"images[{i}] ({len(value)} bytes)", data=bytes(value))
    if isinstance(value, dict):  # Hugging Face datasets' Image feature: {"bytes": ..., "path": ...}
        if value.get("bytes") is not None:
            return _one_ref(value["bytes"], base_dir, i)
        if value.get("path"):
            return _one_ref(value["path"], base_dir, i)
        raise ImageError(f"images[{i}]: a mapping needs 'bytes' or 'path'")
    if isinstance(value, str) and value:
        if value.startswith("data:"):
            header, _, payload = value.partition(",")
            if not header.endswith(";base64"):
                raise ImageError(f"images[{i}]: only base64 data URLs are supported")
            try:
                return ImageRef(f"images[{i}] (data URL)", data=base64.b64decode(payload, validate=True))
            except binascii.Error as exc:
                raise ImageError(f"images[{i}]: data URL is not valid base64: {exc}") from exc
        if value.startswith(("http://", "https://")):
            raise ImageError(f"{value}: remote images are not fetched (offline jobs); download them first")
        p = Path(value).expanduser()
        return ImageRef(str(p if p.is_absolute() else base_dir / p), path=p if p.is_absolute() else base_dir / p)
    raise ImageError(f"images[{i}]: expected a path, bytes or {{bytes, path}}, got {type(value).__name__}")


def image_refs(value: Any, base_dir: Path) -> list[ImageRef]:
    """The images a row's ``images`` column names (none for null or an empty list)."""
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    return [_one_ref(v, base_dir, i) for i, v in enumerate(items)]


def _read(ref: ImageRef) -> bytes:
    if ref.data is not None:
        return ref.data
    assert ref.path is not None
    try:
        return ref.path.read_bytes()
    except FileNotFoundError as exc:
        raise ImageError(f"{ref.source}: no such file") from exc
    except IsADirectoryError as exc:
        raise ImageError(f"{ref.source}: is a folder, not an image file") from exc
    except OSError as exc:
        raise ImageError(f"{ref.source}: cannot be read: {exc.strerror or exc}") from exc


def ref_digest(ref: ImageRef) -> str:
    """sha256 of the image's bytes (for result keys: a changed file gives a new key, so the row runs again)."""
    return hashlib.sha256(_read(ref)).hexdigest()


def pixel_hash(image: Any) -> str:
    """Content hash of an RGB image's decoded pixels (mode and size included)."""
    h = hashlib.sha256(f"{image.mode} {image.width}x{image.height}\n".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def decode_image(data: bytes, source: str) -> Any:
    """Decode ``data`` completely into an RGB PIL image; raises ImageError naming ``source``."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError(f"{source}: empty file, not an image")
    fmt = None
    try:
        with Image.open(io.BytesIO(data)) as probe:
            fmt = probe.format
            probe.verify()  # structure and checksums (PNG CRCs) without decoding
        with Image.open(io.BytesIO(data)) as img:
            img.load()  # decodes every pixel: a truncated file fails here
            rgb = img.convert("RGB")
    except UnidentifiedImageError as exc:
        raise ImageError(f"{source}: not an image (Pillow cannot identify it)") from exc
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{source}: image too large: {exc}") from exc
    except MemoryError:
        raise
    except Exception as exc:  # Pillow reports damage as OSError, SyntaxError, ValueError, even AttributeError
        raise ImageError(f"{source}: truncated or corrupt {fmt or 'image'}: {type(exc).__name__}: {exc}") from exc
    if rgb.width < 1 or rgb.height < 1:
        raise ImageError(f"{source}: image has no pixels")
    return rgb


def load_image(ref: ImageRef) -> ImageInput:
    """Read, fully decode and verify one image; returns it (RGB) with the hash of its pixels."""
    rgb = decode_image(_read(ref), ref.source)
    return ImageInput(rgb, pixel_hash(rgb), ref.source)
