"""Llama 4 image preprocessing and placeholder tokens, checked against the rules of llama4.md §4.1, §4.4."""
from __future__ import annotations

import random
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from strata.errors import ConfigError, RequestError
from strata.multimodal.llama4_image import (
    IMAGE,
    IMAGE_END,
    IMAGE_START,
    PATCH,
    PLACEHOLDER_TOKENS,
    TILE_X_SEPARATOR,
    TILE_Y_SEPARATOR,
    Llama4ImageConfig,
    aspect_ratio_for,
    expand_image_placeholders,
    image_placeholder_text,
    image_placeholder_tokens,
    num_image_features,
    num_tiles,
    placeholder_token_ids,
    preprocess_image,
    resized_size,
    supported_canvases,
)

CONFIG = Llama4ImageConfig()


def spec_aspect_ratio(height: int, width: int, max_tiles: int = 16, tile: int = 336) -> tuple[int, int]:
    """The spec's canvas rule, exactly: smallest scale >= 1, else largest < 1, ties -> least area."""
    grids = [(r, c) for r in range(1, max_tiles + 1) for c in range(1, max_tiles + 1) if r * c <= max_tiles]
    scale = {g: min(Fraction(g[0] * tile, height), Fraction(g[1] * tile, width)) for g in grids}
    up = [s for s in scale.values() if s >= 1]
    chosen = min(up) if up else max(scale.values())
    return min((g for g in grids if scale[g] == chosen), key=lambda g: g[0] * g[1])


def solid(height: int, width: int, color: tuple[int, int, int] = (200, 10, 30)) -> Image.Image:
    return Image.new("RGB", (width, height), color)


@pytest.mark.parametrize(
    ("height", "width", "ratio", "tiles"),
    [
        (336, 336, (1, 1), 1),
        (1, 1, (1, 1), 1),
        (10, 10, (1, 1), 1),
        (500, 500, (2, 2), 5),  # scale 672/500 on 2x2; bigger grids with that scale have more area
        (336, 1000, (1, 3), 4),  # wide: 1x3 reaches scale 1 exactly
        (1000, 200, (3, 1), 4),  # tall: 3x1 gives 1008/1000
        (300, 4000, (1, 12), 13),  # very wide: 12*336/4000 = 1.008 is the smallest upscale
        (4000, 300, (12, 1), 13),
        (3000, 4000, (3, 4), 13),  # must downscale: best is 0.336, reached by 3x4, 3x5, 4x4 -> least area
    ],
)
def test_image_shapes_give_the_expected_tile_grid_and_tensor_shape(height, width, ratio, tiles):
    assert spec_aspect_ratio(height, width) == ratio
    pixels, aspect = preprocess_image(solid(height, width), CONFIG)
    assert aspect == ratio
    assert aspect_ratio_for((height, width), CONFIG) == ratio
    assert num_tiles(aspect) == tiles
    assert tuple(pixels.shape) == (tiles, 3, 336, 336)
    assert pixels.dtype == torch.bfloat16


def test_aspect_ratio_follows_the_spec_rule_for_many_random_shapes():
    rng = random.Random(0)
    shapes = [(rng.randint(1, 5000), rng.randint(1, 5000)) for _ in range(300)]
    shapes += [(rng.randint(1, 400), rng.randint(1, 400)) for _ in range(100)]
    for height, width in shapes:
        assert aspect_ratio_for((height, width), CONFIG) == spec_aspect_ratio(height, width), (height, width)


def test_smaller_max_patches_limits_the_grid():
    config = Llama4ImageConfig(max_patches=4)
    assert aspect_ratio_for((300, 4000), config) == spec_aspect_ratio(300, 4000, max_tiles=4) == (1, 4)
    assert len(supported_canvases(4, 224)) == 8  # 1x1, 1x2, 2x1, 1x3, 3x1, 1x4, 2x2, 4x1


def test_resize_keeps_aspect_and_caps_upscaling_at_one_tile_side():
    assert resized_size((10, 10), (336, 336), 336) == (336, 336)
    assert resized_size((100, 50), (336, 336), 336) == (336, 168)
    assert resized_size((500, 500), (672, 672), 336) == (500, 500)  # fits the canvas: left as is
    assert resized_size((3000, 4000), (1008, 1344), 336) == (1008, 1344)
    assert resized_size((2000, 500), (1344, 336), 336) == (1344, 336)
    assert resized_size((1, 4000), (336, 4032), 336) == (1, 4000)
    # resize_to_max_canvas lets the image grow to the whole canvas
    assert resized_size((100, 50), (672, 336), 336, resize_to_max_canvas=True) == (672, 336)


def test_pixel_values_are_normalized_with_mean_and_std_one_half():
    black, _ = preprocess_image(solid(336, 336, (0, 0, 0)), CONFIG)
    white, _ = preprocess_image(solid(336, 336, (255, 255, 255)), CONFIG)
    assert torch.all(black == -1.0) and torch.all(white == 1.0)
    gray, _ = preprocess_image(solid(336, 336, (128, 64, 192)), CONFIG)
    expected = torch.tensor([128, 64, 192]) / 255 * 2 - 1
    assert torch.allclose(gray.float()[0, :, 0, 0], expected, atol=8e-3)  # bfloat16 has ~3 digits


def test_padding_is_black_below_and_right_of_the_resized_image():
    pixels, aspect = preprocess_image(solid(300, 4000, (255, 255, 255)), CONFIG)
    assert aspect == (1, 12)
    grid = pixels[:12].float()
    last_width = 4000 - 11 * 336  # canvas 4032 wide, image 4000
    assert torch.all(grid[:11, :, :300, :] == 1.0)
    assert torch.all(grid[11, :, :300, :last_width] == 1.0)
    assert torch.all(grid[:, :, 300:, :] == -1.0)  # canvas 336 high, image 300
    assert torch.all(grid[11, :, :, last_width:] == -1.0)
    assert torch.all(pixels[12].float() == 1.0)  # global tile: whole image stretched, no padding


def test_tiles_are_row_major_and_the_global_tile_comes_last():
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]
    array = np.zeros((672, 672, 3), dtype=np.uint8)
    for index, color in enumerate(colors):
        row, col = divmod(index, 2)
        array[row * 336:(row + 1) * 336, col * 336:(col + 1) * 336] = color
    pixels, aspect = preprocess_image(Image.fromarray(array), CONFIG)
    assert aspect == (2, 2) and pixels.shape[0] == 5
    for index, color in enumerate(colors):
        expected = torch.tensor(color, dtype=torch.float32) / 255 * 2 - 1
        assert torch.equal(pixels[index].float()[:, 100, 100], expected)
    global_tile = pixels[4].float()
    for index, color in enumerate(colors):
        row, col = divmod(index, 2)
        expected = torch.tensor(color, dtype=torch.float32) / 255 * 2 - 1
        assert torch.equal(global_tile[:, row * 168 + 80, col * 168 + 80], expected)


def test_downscaled_content_matches_pil_bilinear():
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, size=(30, 40, 3), dtype=np.uint8)
    image = Image.fromarray(array).resize((4000, 3000), Image.NEAREST)  # blocky, so resampling is visible
    pixels, aspect = preprocess_image(image, CONFIG)
    assert aspect == (3, 4)
    reference = np.asarray(image.resize((1344, 1008), Image.BILINEAR), dtype=np.float32) / 255 * 2 - 1
    top_left = pixels[0].float().permute(1, 2, 0).numpy()
    assert np.abs(top_left - reference[:336, :336]).max() < 0.03  # 1-2 levels of 255 plus bfloat16


def test_transparent_pixels_become_white():
    image = Image.new("RGBA", (20, 20), (0, 0, 0, 0))
    pixels, _ = preprocess_image(image, CONFIG)
    assert torch.all(pixels == 1.0)


def test_tokens_per_tile_comes_from_patch_size_tile_size_and_pixel_shuffle():
    assert CONFIG.tokens_per_tile == 144  # (336/14)^2 / 4
    assert Llama4ImageConfig(tile_size=56, patch_size=14).tokens_per_tile == 4
    assert Llama4ImageConfig(tile_size=56, patch_size=14, pixel_shuffle_ratio=1.0).tokens_per_tile == 16


def test_single_tile_placeholder_layout():
    assert image_placeholder_tokens((1, 1), 3) == [IMAGE_START, IMAGE, PATCH, PATCH, PATCH, IMAGE_END]


def test_multi_tile_placeholder_layout_has_separators_and_global_tile_last():
    p, x, y = PATCH, TILE_X_SEPARATOR, TILE_Y_SEPARATOR
    expected = [IMAGE_START, p, p, x, p, p, x, p, p, y, p, p, x, p, p, x, p, p, y, IMAGE, p, p, IMAGE_END]
    assert image_placeholder_tokens((2, 3), 2) == expected
    assert image_placeholder_text((1, 2), 1) == (
        "<|image_start|><|patch|><|tile_x_separator|><|patch|><|tile_y_separator|><|image|><|patch|><|image_end|>"
    )


@pytest.mark.parametrize("aspect", [(1, 1), (2, 2), (1, 12), (3, 4), (4, 4)])
def test_placeholder_has_one_patch_token_per_vision_feature(aspect):
    tokens = image_placeholder_tokens(aspect, 144)
    rows, cols = aspect
    assert tokens.count(PATCH) == num_image_features(aspect, 144) == num_tiles(aspect) * 144
    assert tokens.count(IMAGE) == 1 and tokens[0] == IMAGE_START and tokens[-1] == IMAGE_END
    multi = rows * cols > 1
    assert tokens.count(TILE_X_SEPARATOR) == (rows * (cols - 1) if multi else 0)
    assert tokens.count(TILE_Y_SEPARATOR) == (rows if multi else 0)


VOCAB = {token: 900 + i for i, token in enumerate(PLACEHOLDER_TOKENS)}


def test_expand_image_placeholders_replaces_each_image_token_in_order():
    image = VOCAB[IMAGE]
    prompt = [1, 2, image, 3, image, 4]
    out = expand_image_placeholders(prompt, [(1, 1), (1, 2)], 2, VOCAB)
    first = [VOCAB[t] for t in image_placeholder_tokens((1, 1), 2)]
    second = [VOCAB[t] for t in image_placeholder_tokens((1, 2), 2)]
    assert out == [1, 2, *first, 3, *second, 4]
    assert out.count(VOCAB[PATCH]) == 2 + 3 * 2


def test_expand_image_placeholders_rejects_a_count_mismatch():
    with pytest.raises(RequestError):
        expand_image_placeholders([1, VOCAB[IMAGE]], [(1, 1), (1, 1)], 2, VOCAB)


def test_placeholder_token_ids_reads_the_tokenizer_and_rejects_missing_tokens():
    class FakeTokenizer:
        unk_token_id = 0

        def __init__(self, vocab):
            self.vocab = vocab

        def convert_tokens_to_ids(self, token):
            return self.vocab.get(token, 0)

    assert placeholder_token_ids(FakeTokenizer(VOCAB)) == VOCAB
    with pytest.raises(ConfigError):
        placeholder_token_ids(FakeTokenizer({k: v for k, v in VOCAB.items() if k != PATCH}))


def test_config_from_hf_dict_reads_vision_and_token_fields():
    hf = {
        "image_token_index": 505,
        "boi_token_index": 503,
        "eoi_token_index": 504,
        "vision_config": {"image_size": 56, "patch_size": 14, "pixel_shuffle_ratio": 0.5},
    }
    config = Llama4ImageConfig.from_hf_config(hf, {"max_patches": 4, "resize_to_max_canvas": True})
    assert (config.tile_size, config.patch_size, config.tokens_per_tile) == (56, 14, 4)
    assert (config.image_token_id, config.boi_token_id, config.eoi_token_id) == (505, 503, 504)
    assert config.max_patches == 4 and config.resize_to_max_canvas
    assert config.image_mean == (0.5, 0.5, 0.5)
    scalar = Llama4ImageConfig.from_hf_config(hf, {"image_mean": 0.25, "image_std": [0.1, 0.2, 0.3]})
    assert scalar.image_mean == (0.25, 0.25, 0.25) and scalar.image_std == (0.1, 0.2, 0.3)


def test_config_from_attribute_object_falls_back_to_processor_defaults():
    hf = SimpleNamespace(image_token_id=7, vision_config=SimpleNamespace(patch_size=14))
    config = Llama4ImageConfig.from_hf_config(hf)
    assert config.image_token_id == 7
    assert (config.tile_size, config.max_patches, config.tokens_per_tile) == (336, 16, 144)
    assert config.boi_token_id == 200080


def test_config_rejects_tile_size_not_divisible_by_patch_size():
    with pytest.raises(ConfigError):
        Llama4ImageConfig.from_hf_config({"vision_config": {"image_size": 50, "patch_size": 14}})
