"""Vision-language sample sizes from metadata: the grid from an image's width and height (or
its file's header) equals what the model's image processor gives the decoded image, at
sizes the resize rule rounds, shrinks (over its pixel budget) and grows (under it)."""

from __future__ import annotations

import numpy as np
import pytest

from dcparallel.data.vision_sizes import VisionItem, header_size, image_item, record_items, sample_length

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

#: (width, height): thumbnails, photos, documents over the budget, a strip under it
SIZES = [(224, 224), (640, 480), (1344, 896), (3000, 2000), (40, 60), (301, 17)]


@pytest.fixture(scope="module")
def processor():
    # a budget small enough that the document sizes are shrunk
    return transformers.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 256)


@pytest.mark.parametrize("width,height", SIZES)
def test_grid_from_size_equals_the_processor(processor, width, height):
    image = Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8))
    grid = processor(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    item = image_item(width, height, processor)
    assert list(item.grid) == grid
    assert item.tokens == grid[0] * grid[1] * grid[2] // 4 and item.patches == item.tokens * 4


def test_header_and_record_entries(processor, tmp_path):
    Image.fromarray(np.zeros((480, 640, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    assert header_size(tmp_path / "a.png") == (640, 480)
    items = record_items(
        [{"image": "a.png"}, {"width": 640, "height": 480}, {"grid": [2, 4, 6]}], processor, root=tmp_path
    )
    assert items[0] == items[1] and items[2] == VisionItem((2, 4, 6), 2)
    assert sample_length(10, items) == 10 + 2 * items[0].tokens + 12
    with pytest.raises(ValueError, match="has no size"):
        record_items([{"path": "a.png"}], processor)
