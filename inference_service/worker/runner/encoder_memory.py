"""What encoding images costs in memory, counted against the KV cache's budget at startup.

An image is encoded as crops of the vision tower's input size (one for LLaVA, PaliGemma and Gemma 3;
LLaVA-NeXT's any-resolution patches and Idefics3's tiles are several). A crop's activation peak is
estimated from the tower's shapes, the largest layer's working set: the residual stream, its norm,
q/k/v and the attention output (6 rows of the tower's width), the MLP's two intermediate rows, and the
fp32 attention scores of every head. The server reserves a worst-case request's images: the crops of
the largest image the processor makes (measured by running it) times --max-images-per-request.
Towers that take an image as one sequence of patches at its own size (Qwen2-VL, Qwen2.5-VL) have no
crop size: their "crop" is the largest image the processor keeps, attended as one sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# A picture larger than any processor keeps: its crop count is the processor's most per image.
_LARGEST_IMAGE = (2048, 2048)


@dataclass(frozen=True)
class EncoderBudget:
    crop_values: int  # pixel values in one crop (channels x size x size)
    crop_bytes: int  # activation bytes of encoding one crop
    reserved_bytes: int  # what the KV cache's budget leaves for the encoder

    def bytes_for(self, num_pixel_values: int) -> int:
        """Activation bytes of encoding images of `num_pixel_values` pixel values."""
        return -(-num_pixel_values // self.crop_values) * self.crop_bytes


def crop_bytes(vision_config: Any, dtype: torch.dtype, tokens: int | None = None) -> int:
    """Estimated peak activation bytes of one crop (or one patch sequence of `tokens`) through the tower."""
    if tokens is None:
        size, patch = _pair(vision_config.image_size)[0], _pair(vision_config.patch_size)[0]
        tokens = (size // patch) ** 2 + 1  # patches and a class token
    width = getattr(vision_config, "embed_dim", None) or vision_config.hidden_size
    intermediate = getattr(vision_config, "intermediate_size", None) or getattr(vision_config, "mlp_ratio", 4) * width
    heads = getattr(vision_config, "num_heads", None) or vision_config.num_attention_heads
    item = torch.empty((), dtype=dtype).element_size()
    return tokens * (6 * width + 2 * intermediate) * item + heads * tokens * tokens * 4


def crop_values(vision_config: Any) -> int:
    size = _pair(vision_config.image_size)
    return getattr(vision_config, "num_channels", 3) * size[0] * size[1]


def _largest_pixels(processor: Any) -> Any:
    from PIL import Image

    return processor.image_processor(images=[Image.new("RGB", _LARGEST_IMAGE, (255, 255, 255))], return_tensors="pt")


def worst_crops_per_image(processor: Any, vision_config: Any) -> int:
    """Crops the processor makes of the largest image (at least 1)."""
    return max(1, -(-_largest_pixels(processor)["pixel_values"].numel() // crop_values(vision_config)))


def _patch_sequence_budget(vision_config: Any, processor: Any, dtype: torch.dtype, max_images: int) -> EncoderBudget:
    """Qwen-style towers: the largest image's patches as one sequence, its pixel values as one crop."""
    pixels = _largest_pixels(processor)
    tokens = int(pixels["image_grid_thw"].prod())
    per_image = crop_bytes(vision_config, dtype, tokens)
    return EncoderBudget(int(pixels["pixel_values"].numel()), per_image, max(1, max_images) * per_image)


def encoder_budget(model: Any, processor: Any, max_images: int) -> EncoderBudget:
    """The reservation for encoding one request's images at their worst."""
    vision_config = model.config.vision_config
    dtype = next(model.parameters()).dtype
    if not hasattr(vision_config, "image_size"):
        return _patch_sequence_budget(vision_config, processor, dtype, max_images)
    per_crop = crop_bytes(vision_config, dtype)
    reserved = max(1, max_images) * worst_crops_per_image(processor, vision_config) * per_crop
    return EncoderBudget(crop_values(vision_config), per_crop, reserved)


def _pair(value: Any) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))
