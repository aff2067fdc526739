"""Write the bundled sample images (examples/images/): twelve small pictures of a shape in a colour, each
with its caption beside it (`NAME.png` and `NAME.txt`), the layout kohya's sd-scripts read and `tunecast train`
takes for a diffusion run. A circle, a square and a triangle in red, green, blue and yellow, on a white or a grey
background, drawn with Pillow; some are wider than tall, so that the run's centre crop has work to do.

Deterministic: rerunning rewrites identical files (no randomness; PNG written without metadata).

Run:  .venv/bin/python scripts/make_sample_images.py
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "examples" / "images"

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30)}
SHAPES = ("circle", "square", "triangle")
BACKGROUNDS = {"white": (255, 255, 255), "grey": (128, 128, 128)}


def draw(shape: str, colour: tuple[int, int, int], background: tuple[int, int, int], size: tuple[int, int]) -> object:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, background)
    width, height = size
    side = min(width, height) * 5 // 8
    left, top = (width - side) // 2, (height - side) // 2
    box = (left, top, left + side, top + side)
    pen = ImageDraw.Draw(image)
    if shape == "circle":
        pen.ellipse(box, fill=colour)
    elif shape == "square":
        pen.rectangle(box, fill=colour)
    else:
        pen.polygon([(left + side // 2, top), (left, top + side), (left + side, top + side)], fill=colour)
    return image


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    count = 0
    for index, (colour, shape) in enumerate((c, s) for c in COLOURS for s in SHAPES):
        background = "white" if index % 2 == 0 else "grey"
        size = (64, 48) if index % 3 == 0 else (48, 48)
        name = f"{colour}-{shape}"
        image = draw(shape, COLOURS[colour], BACKGROUNDS[background], size)
        image.save(OUT / f"{name}.png", optimize=True)  # type: ignore[attr-defined]
        (OUT / f"{name}.txt").write_text(f"a {colour} {shape} on a {background} background\n", encoding="utf-8")
        count += 1
    print(f"wrote {count} images with captions to {OUT.relative_to(ROOT)}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
