"""Images of job rows: the ``images`` column -> references and key identity (every pass), then decoded images and
the encoded prompt (only for rows that run).

Owns the job's image rules. A row's ``images`` column holds paths relative to the input file's folder, raw bytes
(Parquet), ``{"bytes", "path"}`` structs or data URLs, one or a list (see ``io.images``); an OpenAI Batch request's
images are its ``image_url`` parts (data URLs or local paths, ``io.jsonl.request_images``). Nothing is opened unless
the model takes images (for a text-only model the row is a ``request`` error), and paths must stay inside the input
file's folder or the job's ``input.image_roots``. The digests of the images' bytes go into the row's result key, so
a changed picture runs its row again on resume. Decoding happens only when the row is submitted; a missing,
unreadable, truncated or non-image file becomes that row's error (kind ``image``), naming the row and the file, and
the job goes on.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mlxbatch.engine import EngineCore
from mlxbatch.errors import InvalidRequestError
from mlxbatch.io import InputRow
from mlxbatch.io.images import IMAGES_COLUMN, ImageError, ImageRef, describe, image_refs, load_image, ref_digest
from mlxbatch.io.jsonl import request_images

__all__ = ["ImageError", "encode_row", "row_images"]


def row_images(row: InputRow, takes_images: bool, roots: tuple[str, ...] = (),
               max_pixels: int | None = None) -> tuple[tuple[ImageRef, ...], str]:
    """The row's image references and their part of the key's identity ("" for rows without images): the digests of
    their bytes, and ``max_pixels`` (``input.max_image_pixels``) when set, since it changes what the model sees.

    Raises InvalidRequestError for images given to a model that takes none (nothing is opened), ImageError (a
    malformed column, a path outside the allowed folders, a file that is missing, not a regular file or too large).
    """
    value = (request_images(row.request) or None) if row.request is not None else row.fields.get(IMAGES_COLUMN)
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return (), ""
    if not takes_images:
        raise InvalidRequestError("images", describe(value), "the model is text-only and cannot take images")
    refs = image_refs(value, Path(row.source).parent, [Path(r) for r in roots])
    if not refs:
        return (), ""
    identity = "\n<images> " + " ".join(ref_digest(r) for r in refs)
    if max_pixels is None:
        return tuple(refs), identity
    return tuple(dataclasses.replace(r, max_pixels=max_pixels) for r in refs), f"{identity} max_pixels={max_pixels}"


def encode_row(core: EngineCore, prompt: Any, images: tuple[ImageRef, ...]) -> Any:
    """What ``core.add_request`` takes for this row: token ids, or a multimodal prompt (images decoded now).

    Raises ImageError for an image that does not decode, InvalidRequestError for a prompt the engine refuses
    (e.g. images for a text-only model).
    """
    if not images:
        return core.encode(prompt)
    return core.encode_images(prompt, [load_image(r) for r in images])
