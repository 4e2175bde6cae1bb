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

A path names a file the job may read only if it resolves (symlinks followed) inside the input file's folder or one
of the job's ``input.image_roots``; it is opened without blocking (a FIFO never hangs the job), only a regular file
of at most ``MAX_IMAGE_BYTES`` is read, and nothing is read before the caller knows the model takes images.
Photos from a Mac or an iPhone: HEIC opens through ``pillow-heif`` when it is installed (else a clear error naming
it), and the EXIF orientation is applied before the pixels are hashed or encoded (the model sees the photo upright).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxbatch.errors import MlxbatchError
from mlxbatch.types import ImageInput

IMAGES_COLUMN = "images"
MAX_IMAGE_BYTES = 64 << 20  # a 48-megapixel HEIC is ~10 MB, an 8K PNG screenshot ~40 MB
# ISO base media "ftyp" brands of HEIF/HEIC files (iPhone and Mac photos), which Pillow opens only with pillow-heif
HEIF_BRANDS = {b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"hevm", b"hevs", b"mif1", b"msf1"}


MIN_IMAGE_PIXELS = 28 * 28  # the least ``input.max_image_pixels``: one image token of a Qwen VL (patch 14, merge 2)


class ImageError(MlxbatchError):
    """An image that cannot be used; the message names the image (file, or bytes of which row)."""


@dataclass(frozen=True)
class ImageRef:
    """Where one image of a row comes from: a local file or bytes carried by the row."""

    source: str  # what messages name: the path as resolved, or "images[i] (N bytes)"
    path: Path | None = None
    data: bytes | None = None
    max_pixels: int | None = None  # decoded larger, it is scaled down to this many pixels (input.max_image_pixels)


def _within(path: Path, roots: Sequence[Path]) -> bool:
    real = os.path.realpath(path)  # follows symlinks; opens nothing
    return any(os.path.commonpath([real, os.path.realpath(r)]) == os.path.realpath(r) for r in roots)


def _one_ref(value: Any, base_dir: Path, i: int, roots: Sequence[Path] = ()) -> ImageRef:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ImageRef(f"images[{i}] ({len(value)} bytes)", data=bytes(value))
    if isinstance(value, dict):  # Hugging Face datasets' Image feature: {"bytes": ..., "path": ...}
        if value.get("bytes") is not None:
            return _one_ref(value["bytes"], base_dir, i, roots)
        if value.get("path"):
            return _one_ref(value["path"], base_dir, i, roots)
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
            raise ImageError(f"{value:.200}: remote images are not fetched (jobs run offline); download it and give "
                             "its local path or a data URL")
        p = Path(value).expanduser()
        p = p if p.is_absolute() else base_dir / p
        allowed = (base_dir, *roots)
        if not _within(p, allowed):
            raise ImageError(f"{p}: outside the folders this job may read images from "
                             f"({', '.join(str(r) for r in allowed)}); list its folder in input.image_roots")
        return ImageRef(str(p), path=p)
    raise ImageError(f"images[{i}]: expected a path, bytes or {{bytes, path}}, got {type(value).__name__}")


def image_refs(value: Any, base_dir: Path, roots: Sequence[Path] = ()) -> list[ImageRef]:
    """The images a row's ``images`` column names (none for null or an empty list). Opens nothing.

    Paths are relative to ``base_dir`` (the input file's folder) and must resolve inside it or one of ``roots``.
    """
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    return [_one_ref(v, base_dir, i, roots) for i, v in enumerate(items)]


def describe(value: Any) -> str:
    """A short description of a row's ``images`` value for messages, without opening anything."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    out = []
    for v in items:
        if isinstance(v, dict):
            v = v.get("path") or v.get("bytes")
        out.append(f"{len(v)} bytes" if isinstance(v, (bytes, bytearray, memoryview))
                   else "a data URL" if isinstance(v, str) and v.startswith("data:") else f"{v!s:.200}")
    return ", ".join(out)


def _kind(mode: int) -> str:
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "not a regular file")


def _read(ref: ImageRef) -> bytes:
    """The bytes of ``ref``: only a regular file, at most MAX_IMAGE_BYTES, opened without blocking."""
    if ref.data is not None:
        return ref.data
    assert ref.path is not None
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(ref.path, flags)
    except FileNotFoundError as exc:
        raise ImageError(f"{ref.source}: no such file") from exc
    except OSError as exc:
        raise ImageError(f"{ref.source}: cannot be read: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ImageError(f"{ref.source}: is a folder, not an image file")
        if not stat.S_ISREG(st.st_mode):
            raise ImageError(f"{ref.source}: is {_kind(st.st_mode)}, not an image file")
        if st.st_size > MAX_IMAGE_BYTES:
            raise ImageError(f"{ref.source}: {st.st_size / 2**20:.0f} MiB, larger than the "
                             f"{MAX_IMAGE_BYTES >> 20} MiB an image file may have")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    except OSError as exc:
        raise ImageError(f"{ref.source}: cannot be read: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    if len(data) > MAX_IMAGE_BYTES:  # it grew while being read
        raise ImageError(f"{ref.source}: larger than the {MAX_IMAGE_BYTES >> 20} MiB an image file may have")
    return data


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
    heif_missing = data[4:8] == b"ftyp" and data[8:12] in HEIF_BRANDS and not _register_heif()
    fmt = None
    try:
        with Image.open(io.BytesIO(data)) as probe:
            fmt = probe.format
            probe.verify()  # structure and checksums (PNG CRCs) without decoding
        with Image.open(io.BytesIO(data)) as img:
            img.load()  # decodes every pixel: a truncated file fails here
            rgb = upright(img).convert("RGB")
    except UnidentifiedImageError as exc:
        if heif_missing:
            raise ImageError(f"{source}: a HEIC/HEIF photo; opening it needs the pillow-heif package "
                             "(pip install pillow-heif, or install mlxbatch with the vlm extra)") from exc
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


def upright(img: Any) -> Any:
    """``img`` turned as its EXIF orientation tag says (a phone's portrait photo is stored sideways); as stored when
    the EXIF block cannot be parsed (the pixels are fine)."""
    from PIL import ImageOps

    try:
        return ImageOps.exif_transpose(img)
    except Exception:  # malformed EXIF: Pillow raises SyntaxError, ValueError, struct.error, ...
        return img


_heif_registered = False


def _register_heif() -> bool:
    """Let Pillow open HEIF/HEIC (Apple's photo format) through pillow-heif; False when it is not installed."""
    global _heif_registered
    if not _heif_registered:
        try:
            from pillow_heif import register_heif_opener
        except ImportError:
            return False
        register_heif_opener()
        _heif_registered = True
    return True


def load_image(ref: ImageRef) -> ImageInput:
    """Read, fully decode and verify one image; returns it (RGB, within ``ref.max_pixels``) with the hash of its
    pixels."""
    rgb = decode_image(_read(ref), ref.source)
    if ref.max_pixels is not None:
        rgb = within_pixels(rgb, ref.max_pixels)
    return ImageInput(rgb, pixel_hash(rgb), ref.source)


def within_pixels(img: Any, most: int) -> Any:
    """``img`` scaled down (aspect kept, Lanczos) to at most ``most`` pixels; as it is when it has no more. A model's
    processor turns a photo's pixels into image tokens (Qwen2-VL: one per 28 x 28, up to 16,384 by its checkpoints'
    defaults): a 12-megapixel phone photo would be ~15,000 tokens and a vision-tower pass over ~61,000 patches."""
    from PIL import Image

    w, h = img.size
    if w * h <= most:
        return img
    scale = math.sqrt(most / (w * h))
    w2 = max(1, math.floor(w * scale))  # (a side under one pixel is one: the other side then takes what is left)
    h2 = max(1, min(math.floor(h * scale), most // w2))
    return img.resize((min(w2, most // h2), h2), Image.Resampling.LANCZOS)
