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
    refs = image_refs(["a.png", str(tmp_path / "sub" / "b.png"), png, {"bytes": png, "path": "x"},
                       {"bytes": None, "path": "c.png"}, url], tmp_path)
    assert [r.path for r in refs[:2]] == [tmp_path / "a.png", tmp_path / "sub" / "b.png"]
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


def finishes(fn, seconds: float = 10.0):
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it blocks, e.g. reading a FIFO."""
    import threading

    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"blocked for more than {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_only_regular_files_of_bounded_size_are_read(tmp_path, monkeypatch):
    import os

    from mlxbatch.io import images

    os.mkfifo(tmp_path / "pipe.png")
    with pytest.raises(ImageError, match="pipe.png: is a FIFO"):
        finishes(lambda: ref_digest(image_refs("pipe.png", tmp_path)[0]))
    with pytest.raises(ImageError, match="/dev/zero: is a device"):  # allowed folder, still never read
        finishes(lambda: load_image(image_refs("/dev/zero", tmp_path, [Path("/dev")])[0]))
    big = tmp_path / "huge.png"
    with open(big, "wb") as f:  # sparse: costs no disk, and must not be read
        f.truncate(images.MAX_IMAGE_BYTES + 1)
    with pytest.raises(ImageError, match=r"huge.png: 64 MiB, larger than the 64 MiB"):
        ref_digest(image_refs("huge.png", tmp_path)[0])
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 100)
    (tmp_path / "p.png").write_bytes(encoded(synthetic_image(1), "PNG"))
    with pytest.raises(ImageError, match="larger than"):
        ref_digest(image_refs("p.png", tmp_path)[0])


def test_paths_must_stay_inside_the_input_folder_or_the_allowed_roots(tmp_path):
    data, photos = tmp_path / "job" / "data", tmp_path / "photos"
    data.mkdir(parents=True)
    photos.mkdir()
    png = encoded(synthetic_image(2), "PNG")
    (photos / "cat.png").write_bytes(png)
    (data / "sub").mkdir()
    (data / "sub" / "dog.png").write_bytes(png)
    (data / "escape.png").symlink_to(photos / "cat.png")  # a link inside that leads outside
    (data / "inside.png").symlink_to(data / "sub" / "dog.png")
    for value in ("/etc/passwd", "../../photos/cat.png", "sub/../../../photos/cat.png", "escape.png",
                  str(photos / "cat.png"), {"bytes": None, "path": "/etc/hostname"}):
        with pytest.raises(ImageError, match="outside the folders this job may read images from.*image_roots"):
            image_refs(value, data)
    assert ref_digest(image_refs("sub/dog.png", data)[0]) == ref_digest(image_refs("inside.png", data)[0])
    assert ref_digest(image_refs(str(data / "sub" / "dog.png"), data)[0])  # absolute, but inside: fine
    for value in ("escape.png", "../../photos/cat.png", str(photos / "cat.png")):  # once photos/ is allowed
        assert load_image(image_refs(value, data, [photos])[0]).content_hash == pixel_hash(synthetic_image(2))


def test_exif_orientation_is_applied_before_hashing(tmp_path):
    # a 60x40 picture whose left half is red and right half blue, stored as a camera does: pixels unrotated, EXIF
    # Orientation 6 ("rotate 90 degrees clockwise to view")
    img = Image.new("RGB", (60, 40), (220, 20, 20))
    img.paste((20, 20, 220), (30, 0, 60, 40))
    exif = Image.Exif()
    exif[0x0112] = 6
    (tmp_path / "photo.jpg").write_bytes(encoded(img, "JPEG", quality=95, exif=exif))
    loaded = load_image(image_refs("photo.jpg", tmp_path)[0])
    assert loaded.image.size == (40, 60)  # upright: portrait
    top, bottom = loaded.image.getpixel((20, 5)), loaded.image.getpixel((20, 55))
    assert top[0] > 180 and top[2] < 60 and bottom[2] > 180 and bottom[0] < 60  # red on top, blue below
    upright = img.transpose(Image.Transpose.ROTATE_270)
    (tmp_path / "upright.jpg").write_bytes(encoded(upright, "JPEG", quality=95))
    plain = load_image(image_refs("upright.jpg", tmp_path)[0])
    assert plain.image.size == loaded.image.size


def test_heic_photos_open_with_pillow_heif(tmp_path):
    pillow_heif = pytest.importorskip("pillow_heif")
    img = synthetic_image(6, 64, 48)
    pillow_heif.from_pillow(img).save(str(tmp_path / "IMG_0001.HEIC"), quality=95)
    loaded = load_image(image_refs("IMG_0001.HEIC", tmp_path)[0])
    assert loaded.image.size == (64, 48) and loaded.image.mode == "RGB"


def test_heic_without_pillow_heif_is_a_clear_error(tmp_path):
    import subprocess
    import sys

    pillow_heif = pytest.importorskip("pillow_heif")  # to write the file; the check runs where it is missing
    pillow_heif.from_pillow(synthetic_image(6, 64, 48)).save(str(tmp_path / "IMG_0002.heic"))
    code = ("import sys; sys.modules['pillow_heif'] = None\n"  # as if it were not installed
            "from pathlib import Path\nfrom mlxbatch.io.images import ImageError, image_refs, load_image\n"
            f"try:\n    load_image(image_refs('IMG_0002.heic', Path({str(tmp_path)!r}))[0])\n"
            "except ImageError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "IMG_0002.heic: a HEIC/HEIF photo; opening it needs the pillow-heif package" in out.stdout, out.stderr


def test_an_image_over_the_pixel_bound_is_scaled_down_keeping_its_shape(tmp_path):
    """``input.max_image_pixels``: a phone photo's pixels become thousands of image tokens; past the bound an image
    is scaled down (aspect kept) after it is turned upright, and one within it is left exactly as it is."""
    import dataclasses

    big, small = tmp_path / "big.png", tmp_path / "small.png"
    synthetic_image(1, 400, 300).save(big)
    synthetic_image(2, 60, 40).save(small)
    (ref_big,), (ref_small,) = image_refs("big.png", tmp_path), image_refs("small.png", tmp_path)
    bound = 112 * 84 + 50
    got = load_image(dataclasses.replace(ref_big, max_pixels=bound)).image
    assert got.width * got.height <= bound and abs(got.width / got.height - 4 / 3) < 0.02, got.size
    assert got.width >= 110  # (as large as the bound allows, give or take rounding)
    plain = load_image(ref_small)
    kept = load_image(dataclasses.replace(ref_small, max_pixels=bound))
    assert kept.image.size == (60, 40) and kept.content_hash == plain.content_hash
    assert load_image(ref_big).image.size == (400, 300)  # no bound: as it is
    strip = tmp_path / "strip.png"  # a side scaled under one pixel is one; the other keeps within the bound
    Image.new("RGB", (4000, 3)).save(strip)
    (ref_strip,) = image_refs("strip.png", tmp_path)
    got = load_image(dataclasses.replace(ref_strip, max_pixels=784)).image
    assert got.height == 1 and got.width * got.height <= 784, got.size
