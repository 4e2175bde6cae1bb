"""Images of rows (io.images): references, full decoding and verification, content hashes."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest

pytest.importorskip("PIL", reason="Pillow comes with the vlm extra")

from PIL import Image  # noqa: E402

from mlxbatch.io.images import ImageError, image_refs, load_image, pixel_hash, ref_digest  # noqa: E402
from mlxbatch.models.random_vlm import synthetic_image  # noqa: E402


def encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def test_refs_from_paths_bytes_structs_and_data_urls(tmp_path):
    png = encoded(synthetic_image(1), "PNG")
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    refs = image_refs(["a.png", "/abs/b.png", png, {"bytes": png, "path": "x"}, {"bytes": None, "path": "c.png"}, url],
                      tmp_path)
    assert [r.path for r in refs[:2]] == [tmp_path / "a.png", Path("/abs/b.png")]
    assert refs[2].data == refs[3].data == refs[5].data == png and refs[4].path == tmp_path / "c.png"
    assert image_refs(None, tmp_path) == [] and image_refs([], tmp_path) == []
    assert len(image_refs("one.png", tmp_path)) == 1
    for bad, words in ((42, "expected a path"), ("https://x.org/a.png", "remote images"), ({}, "needs 'bytes'"),
                       ("data:image/png,abc", "base64")):
        with pytest.raises(ImageError, match=words):
            image_refs(bad, tmp_path)


def test_same_pixels_same_hash_whatever_the_encoding(tmp_path):
    img = synthetic_image(3, 90, 60)
    (tmp_path / "p.png").write_bytes(encoded(img, "PNG"))
    forms = [encoded(img, "PNG", optimize=True), encoded(img, "BMP"), encoded(img.convert("RGBA"), "PNG"),
             encoded(img, "TIFF")]
    from_file = load_image(image_refs("p.png", tmp_path)[0])
    assert from_file.content_hash == pixel_hash(img) and from_file.image.mode == "RGB"
    for data in forms:
        assert load_image(image_refs(data, tmp_path)[0]).content_hash == from_file.content_hash
    other = synthetic_image(4, 90, 60)
    assert load_image(image_refs(encoded(other, "PNG"), tmp_path)[0]).content_hash != from_file.content_hash
    # one pixel changed: another hash; the same pixels at another size: another hash
    tweaked = img.copy()
    tweaked.putpixel((0, 0), (0, 0, 0) if img.getpixel((0, 0)) != (0, 0, 0) else (1, 1, 1))
    assert pixel_hash(tweaked) != pixel_hash(img)
    # byte digests (result keys) differ between encodings even when the pixels match
    assert ref_digest(image_refs(forms[0], tmp_path)[0]) != ref_digest(image_refs(forms[1], tmp_path)[0])


@pytest.mark.parametrize("name,content,words", [
    ("missing.png", None, "missing.png: no such file"),
    ("empty.png", b"", "empty file"),
    ("text.png", b"hello, not a picture", "not an image"),
    ("cut.png", "png-half", "truncated or corrupt PNG"),
    ("cut.jpg", "jpeg-half", "truncated or corrupt JPEG"),
    ("bad-crc.png", "png-crc", "truncated or corrupt PNG"),
])
def test_bad_images_raise_errors_naming_the_file(tmp_path, name, content, words):
    img = synthetic_image(5, 128, 128)
    if content == "png-half":
        content = encoded(img, "PNG")[:-200]
    elif content == "jpeg-half":
        data = encoded(img, "JPEG", quality=90)
        content = data[: len(data) // 2]
    elif content == "png-crc":
        data = bytearray(encoded(img, "PNG"))
        data[60] ^= 0xFF  # inside the first IDAT chunk: its CRC no longer matches
        content = bytes(data)
    if content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(ImageError, match=words) as err:
        load_image(image_refs(name, tmp_path)[0])
    assert str(tmp_path / name) in str(err.value)


def test_a_folder_is_not_an_image(tmp_path):
    with pytest.raises(ImageError, match="is a folder"):
        ref_digest(image_refs(".", tmp_path)[0])
