"""Writes the image-labeling example's data: jobs/data/images/*.png and jobs/data/shapes.jsonl.

Each picture is one shape (circle, square or triangle) in one colour on a plain background, 112x112 pixels, so a real
vision-language model can label it. Every picture gets two rows (which shape? which colour?), with the answer in the
`answer` column: the second question about a picture reuses its vision features. Deterministic; output is committed.
Usage: .venv/bin/python scripts/make_caption_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parent.parent / "jobs" / "data"
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (240, 210, 20),
           "black": (15, 15, 15), "purple": (130, 40, 170)}
BACKGROUNDS = [(250, 250, 250), (200, 200, 200), (245, 235, 210)]
SHAPES = ("circle", "square", "triangle")
SIZE = 112


def draw(shape: str, colour: tuple[int, int, int], background: tuple[int, int, int], rng: random.Random) -> Image.Image:
    img = Image.new("RGB", (SIZE, SIZE), background)
    d = ImageDraw.Draw(img)
    side = rng.randint(44, 72)
    x, y = rng.randint(6, SIZE - side - 6), rng.randint(6, SIZE - side - 6)
    if shape == "circle":
        d.ellipse([x, y, x + side, y + side], fill=colour)
    elif shape == "square":
        d.rectangle([x, y, x + side, y + side], fill=colour)
    else:
        d.polygon([(x + side // 2, y), (x, y + side), (x + side, y + side)], fill=colour)
    return img


def main(n: int = 24) -> None:
    rng = random.Random(20261130)
    (OUT / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        shape, colour = SHAPES[i % len(SHAPES)], rng.choice(sorted(COLOURS))
        name = f"images/shape-{i:02d}.png"
        draw(shape, COLOURS[colour], rng.choice(BACKGROUNDS), rng).save(OUT / name, optimize=True)
        rows.append({"id": f"shape-{i:02d}-shape", "images": name, "answer": shape,
                     "question": "Which shape is in this picture: circle, square or triangle?"})
        rows.append({"id": f"shape-{i:02d}-colour", "images": name, "answer": colour,
                     "question": f"What colour is the shape: {', '.join(sorted(COLOURS))}?"})
    (OUT / "shapes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {n} images to {OUT / 'images'} and {len(rows)} rows to {OUT / 'shapes.jsonl'}")


if __name__ == "__main__":
    main()
