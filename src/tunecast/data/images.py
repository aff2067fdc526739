"""The images and captions a diffusion model trains on: a local folder, in one of two layouts.

* Captions beside the images: `cat.png` and `cat.txt` (the caption is the text file's content, stripped), as
  kohya's sd-scripts and SimpleTuner read them. Every image needs its caption.
* Hugging Face's imagefolder layout: a `metadata.jsonl` whose lines each name an image (`file_name`, relative to
  the folder) and its caption (`text`), as `datasets.load_dataset("imagefolder")` and diffusers' training examples
  read it. When the file is there, it alone says which images are trained on.

Each image is made the training size as diffusers' train_text_to_image.py does (`Resize` then `CenterCrop`): scaled
with bilinear filtering so that it covers the resolution, then cut to it around its centre; then RGB in [-1, 1],
channels first. Anything wrong (no image, an image that does not open, a caption missing, empty or unreadable, a
metadata line that is not JSON or lacks a field) is an error naming the file and the field. Pillow only; no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunecast.errors import TunecastError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
METADATA = "metadata.jsonl"
FIELD = "dataset.path"


@dataclass(frozen=True)
class Captioned:
    """One training image and its caption."""

    image: Path
    caption: str


def _bad(message: str, hint: str) -> TunecastError:
    return TunecastError(message, field=FIELD, hint=hint)


def read_image_folder(path: str) -> list[Captioned]:
    """The folder's images and captions, in name order (or metadata.jsonl's), each image checked to open."""
    found = list_image_folder(path)
    for item in found:
        _check_opens(item.image)
    return found


def list_image_folder(path: str) -> list[Captioned]:
    """The images a run on the folder trains on and their captions, as read_image_folder finds them, without opening
    the images: a plan counts what the run will read (the folder's top level, or the images metadata.jsonl names,
    which may lie in sub-folders), with the same errors for a caption missing."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise _bad(f"{path} is not a folder of images", "a diffusion run trains on a folder of images with a .txt "
                   f"caption beside each, or a {METADATA} (file_name, text)")
    found = _from_metadata(folder) if (folder / METADATA).is_file() else _from_captions(folder)
    if not found:
        raise _bad(f"{path} holds no image ({', '.join(IMAGE_SUFFIXES)})", "put the training images there")
    return found


def _from_captions(folder: Path) -> list[Captioned]:
    found = []
    for image in sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()):
        caption_file = image.with_suffix(".txt")
        if not caption_file.is_file():
            raise _bad(f"{image}: no caption ({caption_file.name} is missing)",
                       f"write its caption in {caption_file.name}, or list the images in a {METADATA}")
        try:
            caption = caption_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            raise _bad(f"{caption_file}: the caption cannot be read ({error})", "save it as UTF-8 text") from None
        if not caption:
            raise _bad(f"{caption_file}: the caption is empty", "write the image's caption in it")
        found.append(Captioned(image, caption))
    return found


def _from_metadata(folder: Path) -> list[Captioned]:
    metadata = folder / METADATA
    found = []
    for number, line in enumerate(metadata.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{metadata} line {number}"
        try:
            record: Any = json.loads(line)
        except ValueError as error:
            raise _bad(f"{where}: not JSON ({error})", 'write one object a line: {"file_name": ..., "text": ...}') \
                from None
        if not isinstance(record, dict):
            raise _bad(f"{where}: not a JSON object", 'write one object a line: {"file_name": ..., "text": ...}')
        for key in ("file_name", "text"):
            if not isinstance(record.get(key), str) or not record[key].strip():
                raise _bad(f"{where}: field {key!r} is missing or not text",
                           "each line names its image (file_name, relative to the folder) and its caption (text)")
        image = folder / record["file_name"]
        if not image.is_file():
            raise _bad(f"{where}: field 'file_name' names {record['file_name']}, which is not in {folder}",
                       "check the file name, relative to the folder that holds metadata.jsonl")
        found.append(Captioned(image, record["text"].strip()))
    return found


def _check_opens(image: Path) -> None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(image) as opened:
            opened.verify()
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as error:
        raise _bad(f"{image}: cannot be read as an image ({str(error).splitlines()[0]})",
                   "replace or remove the file") from None


def _cover(source: tuple[int, int], width: int, height: int) -> tuple[tuple[int, int], int, int]:
    """An image of `source` (width, height) scaled to cover width × height: its scaled size, and the left and top of
    the centred crop in it."""
    scale = max(width / source[0], height / source[1])
    size = (max(width, round(source[0] * scale)), max(height, round(source[1] * scale)))
    return size, (size[0] - width) // 2, (size[1] - height) // 2


def load_pixels(image: Path, width: int, height: int) -> Any:
    """The image at the training size: scaled (bilinear) to cover width × height, cropped around its centre, RGB in
    [-1, 1] as float32, shape (3, height, width): a NumPy array."""
    import numpy as np
    from PIL import Image

    with Image.open(image) as opened:
        rgb = opened.convert("RGB")
    size, left, top = _cover(rgb.size, width, height)
    resized = rgb.resize(size, Image.Resampling.BILINEAR)
    cropped = resized.crop((left, top, left + width, top + height))
    pixels = np.asarray(cropped, dtype=np.float32) / 127.5 - 1.0  # (height, width, 3)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def size_conditioning(image: Path, width: int, height: int) -> tuple[int, int, int, int, int, int]:
    """SDXL's size conditioning of the image at the training size (train_text_to_image_sdxl.py's add_time_ids): its
    original (height, width), the crop's (top, left) in the scaled image, and the training (height, width)."""
    from PIL import Image

    with Image.open(image) as opened:
        source = opened.size
    _, left, top = _cover(source, width, height)
    return source[1], source[0], top, left, height, width


# Aspect-ratio buckets (`diffusion.buckets`): the sides a bucket may have are multiples of a step, from half the
# resolution's side to twice it, as kohya's make_bucket_resolutions steps them: 64 px (its default bucket_reso_steps),
# which keeps every side on the estimate's grid (estimate/diffusion_fit.py) and divides by every catalog denoiser's
# downsampling; smaller only for a resolution too small for it (the denoiser's own grid: train/diffusion_loop.py).
BUCKET_STEP = 64


def aspect_buckets(width: int, height: int, step: int = BUCKET_STEP) -> list[tuple[int, int]]:
    """The buckets of a run at width × height: for each width w on the step's grid, the tallest height on it with
    w × h at most the resolution's area; and the same turned. Every bucket holds no more pixels than the resolution,
    so the resolution's own shape (among them where its sides are on the grid) sets the step's peak."""
    area = width * height
    side = math.isqrt(area)
    low = max(step, side // 2 // step * step)
    high = max(low, 2 * side // step * step)
    found: set[tuple[int, int]] = set()
    for w in range(low, high + 1, step):
        h = min(high, area // w // step * step)
        if h >= low:
            found.update({(w, h), (h, w)})
    if width % step == 0 and height % step == 0:
        found.add((width, height))
    return sorted(found)


def bucket_step(grid: int, width: int, height: int) -> int:
    """The step of a run's aspect buckets: BUCKET_STEP (kohya's 64 px), or the denoiser's own `grid`
    (catalog/diffusion.Pipeline.grid) where the resolution is too small for four such steps a side (the tiny test
    pipelines) or the grid does not divide it."""
    if min(width, height) >= 4 * BUCKET_STEP and BUCKET_STEP % grid == 0:
        return BUCKET_STEP
    return grid


def image_size(image: Path) -> tuple[int, int]:
    """(width, height) of an image, from its header."""
    from PIL import Image

    with Image.open(image) as opened:
        return opened.size


def nearest_bucket(size: tuple[int, int], buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is nearest the image's (on a log scale, so that 2:1 and 1:2 are as far from
    1:1); of those as near, the largest."""
    ratio = math.log(size[0] / size[1])
    return min(buckets, key=lambda bucket: (round(abs(math.log(bucket[0] / bucket[1]) - ratio), 9),
                                           -bucket[0] * bucket[1]))


def training_sizes(images: list[Path], width: int, height: int, grid: int, buckets: bool) -> list[tuple[int, int]]:
    """Each image's training (width, height) at a run's resolution `width` × `height` for a denoiser on `grid`
    (catalog/diffusion.Pipeline.grid): with `buckets`, its aspect bucket's (bucket_step's grid); else the resolution."""
    if not buckets:
        return [(width, height)] * len(images)
    choices = aspect_buckets(width, height, bucket_step(grid, width, height))
    return [nearest_bucket(image_size(image), choices) for image in images]


def epoch_micro_batches(order: list[int], groups: list[tuple[int, int]], micro_batch: int) -> list[list[int]]:
    """An epoch's micro-batches: `order` (the epoch's units, each an index into `groups`, shuffled) taken in turn,
    each unit joining the open micro-batch of its group (its training size), a micro-batch closed when full or when
    the epoch ends. One group gives `order` cut into micro-batches. The micro-batches are in the order they were
    opened; the same order and groups give the same micro-batches."""
    opened: dict[tuple[int, int], list[int]] = {}
    batches: list[list[int]] = []
    for unit in order:
        group = groups[unit]
        if group not in opened:
            opened[group] = []
            batches.append(opened[group])
        opened[group].append(unit)
        if len(opened[group]) == micro_batch:
            del opened[group]
    return batches


def micro_batches_per_epoch(sizes: list[tuple[int, int]], repeats: int, micro_batch: int) -> int:
    """How many micro-batches an epoch has (epoch_micro_batches): each training size's images × repeats, in
    micro-batches of `micro_batch`, the last of each size partial."""
    from collections import Counter

    return sum(math.ceil(count * repeats / micro_batch) for count in Counter(sizes).values())
