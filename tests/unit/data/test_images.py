"""A diffusion run's images and captions: both layouts read, every kind of bad data named with its file and field,
and each image made the training size as diffusers' examples make it (cover, then centre crop; RGB in [-1, 1])."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tunecast.data.images import load_pixels, read_image_folder
from tunecast.errors import TunecastError


def _image(path: Path, size: tuple[int, int] = (8, 8), colour: tuple[int, int, int] = (255, 0, 0)) -> Path:
    Image.new("RGB", size, colour).save(path)
    return path


def test_captions_beside_the_images_in_name_order(tmp_path: Path) -> None:
    for name in ("b", "a"):
        _image(tmp_path / f"{name}.png")
        (tmp_path / f"{name}.txt").write_text(f"  picture {name}\n")
    found = read_image_folder(str(tmp_path))
    assert [(item.image.name, item.caption) for item in found] == [("a.png", "picture a"), ("b.png", "picture b")]


def test_metadata_jsonl_alone_says_what_is_trained(tmp_path: Path) -> None:
    _image(tmp_path / "one.png")
    _image(tmp_path / "unlisted.png")  # no caption and not listed: not read
    (tmp_path / "sub").mkdir()
    _image(tmp_path / "sub" / "two.jpg")
    lines = [{"file_name": "sub/two.jpg", "text": "second"}, {"file_name": "one.png", "text": "first"}]
    (tmp_path / "metadata.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    found = read_image_folder(str(tmp_path))
    assert [(item.image.relative_to(tmp_path).as_posix(), item.caption) for item in found] == \
        [("sub/two.jpg", "second"), ("one.png", "first")]


@pytest.mark.parametrize(("setup", "said"), [
    (lambda d: _image(d / "a.png"), r"a\.png: no caption \(a\.txt is missing\)"),
    (lambda d: (_image(d / "a.png"), (d / "a.txt").write_text(" \n")), r"a\.txt: the caption is empty"),
    (lambda d: (d / "metadata.jsonl").write_text("{nope\n"), r"metadata\.jsonl line 1: not JSON"),
    (lambda d: (d / "metadata.jsonl").write_text('{"file_name": "a.png"}\n'),
     r"metadata\.jsonl line 1: field 'text' is missing"),
    (lambda d: (d / "metadata.jsonl").write_text('\n{"text": "x", "file_name": 3}\n'),
     r"metadata\.jsonl line 2: field 'file_name' is missing"),
    (lambda d: (d / "metadata.jsonl").write_text('{"file_name": "gone.png", "text": "x"}\n'),
     r"line 1: field 'file_name' names gone\.png, which is not in"),
    (lambda d: ((d / "a.png").write_bytes(b"\x89PNG broken"), (d / "a.txt").write_text("x")),
     r"a\.png: cannot be read as an image"),
    (lambda d: (d / "notes.txt").write_text("no images"), r"holds no image"),
])
def test_bad_data_names_the_file_and_field(tmp_path: Path, setup: object, said: str) -> None:
    setup(tmp_path)  # type: ignore[operator]
    with pytest.raises(TunecastError, match=said) as raised:
        read_image_folder(str(tmp_path))
    assert raised.value.field == "dataset.path" and raised.value.hint


def test_not_a_folder(tmp_path: Path) -> None:
    with pytest.raises(TunecastError, match="is not a folder of images"):
        read_image_folder(str(tmp_path / "missing"))


def test_pixels_cover_then_centre_crop(tmp_path: Path) -> None:
    image = Image.new("RGB", (12, 6), (0, 0, 0))  # black left and right thirds, white middle
    image.paste((255, 255, 255), (4, 0, 8, 6))
    image.save(tmp_path / "wide.png")
    pixels = load_pixels(tmp_path / "wide.png", 4, 4)  # scaled to 8 × 4 to cover 4 × 4, then its middle 4 columns
    assert pixels.shape == (3, 4, 4) and pixels.dtype == np.float32
    assert pixels.min() >= -1.0 and pixels.max() <= 1.0
    assert pixels[:, :, 1:3].mean() > 0.5 and pixels[:, :, 0].mean() < pixels[:, :, 1].mean()


def test_pixels_of_a_non_square_resolution(tmp_path: Path) -> None:
    _image(tmp_path / "square.png", (10, 10), (0, 0, 255))
    pixels = load_pixels(tmp_path / "square.png", 8, 4)  # width 8, height 4
    assert pixels.shape == (3, 4, 8)
    assert np.allclose(pixels[2], 1.0) and np.allclose(pixels[0], -1.0)


def test_aspect_buckets_hold_no_more_pixels_than_the_resolution_and_each_image_takes_the_nearest_ratio() -> None:
    from tunecast.data.images import aspect_buckets, nearest_bucket

    buckets = aspect_buckets(1024, 1024)
    assert (1024, 1024) in buckets and all(w * h <= 1024 * 1024 for w, h in buckets)
    assert all(w % 64 == 0 and h % 64 == 0 and min(w, h) >= 512 and max(w, h) <= 2048 for w, h in buckets)
    assert all((h, w) in buckets for w, h in buckets)
    assert nearest_bucket((1920, 1080), buckets) == (1344, 768)  # 16:9 → 1.75
    assert nearest_bucket((1080, 1920), buckets) == (768, 1344)
    assert nearest_bucket((500, 500), buckets) == (1024, 1024)  # upscaled to the square
    assert (768, 512) in aspect_buckets(768, 512) and all(w * h <= 768 * 512 for w, h in aspect_buckets(768, 512))


def test_an_epoch_s_micro_batches_hold_one_size_each_and_every_unit_once() -> None:
    from tunecast.data.images import epoch_micro_batches, micro_batches_per_epoch

    sizes = [(64, 32), (32, 64), (48, 48)] * 3 + [(48, 48)]
    order = [7, 2, 9, 0, 5, 1, 3, 8, 6, 4]
    batches = epoch_micro_batches(order, sizes, 3)
    assert sorted(unit for batch in batches for unit in batch) == list(range(10))
    assert all(len({sizes[unit] for unit in batch}) == 1 and len(batch) <= 3 for batch in batches)
    assert len(batches) == micro_batches_per_epoch(sizes, 1, 3) == 1 + 1 + 2  # the square's 4 make 3 + 1
    assert batches == epoch_micro_batches(order, sizes, 3)
    assert epoch_micro_batches(order, [(8, 8)] * 10, 4) == [order[:4], order[4:8], order[8:]]
