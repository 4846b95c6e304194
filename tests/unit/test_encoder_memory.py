"""The image encoder's memory: its estimate, its share of the KV cache's budget, the batches it
encodes in, and the typed refusal of images that need more."""

from __future__ import annotations

import pytest
import torch

from inference_service.config import CacheConfig
from inference_service.engine.kv_sizing import plan_num_blocks
from inference_service.errors import ModelLoadError, ValidationError
from inference_service.frontend.image_memory import check_encoder_memory
from inference_service.sampling_params import ImageInput
from inference_service.worker.attention.kv_cache import LayerShape, PagedKVCache
from inference_service.worker.runner.encoder_memory import EncoderBudget, crop_bytes, crop_values
from inference_service.worker.runner.image_encoder import ImageEncoder
from tests.unit.test_image_inputs import _info as engine_info


def siglip():
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, image_size=32, patch_size=8)


def test_a_crop_costs_its_largest_layer_working_set():
    tokens = 16 + 1
    assert crop_bytes(siglip(), torch.float32) == tokens * (6 * 32 + 2 * 64) * 4 + 4 * tokens * tokens * 4
    assert crop_bytes(siglip(), torch.bfloat16) < crop_bytes(siglip(), torch.float32)
    assert crop_values(siglip()) == 3 * 32 * 32


def test_the_encoder_share_comes_out_of_the_kv_budget():
    shapes = [LayerShape(num_kv_heads=2, head_dim=16)] * 2
    cache = CacheConfig(kv_cache_memory="1MiB", block_size=4)
    per_block = PagedKVCache.bytes_per_token(shapes, torch.float32) * 4
    cpu = torch.device("cpu")
    assert plan_num_blocks(cache, shapes, torch.float32, cpu) == 2**20 // per_block
    assert plan_num_blocks(cache, shapes, torch.float32, cpu, reserved_bytes=2**19) == 2**19 // per_block
    with pytest.raises(ModelLoadError, match="less 1048576 for the image encoder.*--max-images-per-request"):
        plan_num_blocks(cache, shapes, torch.float32, cpu, reserved_bytes=2**20)
    # A capacity in tokens is a capacity: the encoder's share is not taken from it.
    tokens = CacheConfig(max_batch_total_tokens=64, block_size=4)
    assert plan_num_blocks(tokens, shapes, torch.float32, cpu, reserved_bytes=2**19) == 16


def image(num_crops: int) -> ImageInput:
    return ImageInput(positions=(0,), content_hash=b"x" * 8, pixel_values=torch.zeros(1, num_crops, 3, 32, 32))


def test_images_needing_more_than_the_encoder_keeps_are_refused():
    budget = EncoderBudget(crop_values=3 * 32 * 32, crop_bytes=1000, reserved_bytes=5000)
    info = engine_info(
        encoder_crop_values=budget.crop_values,
        encoder_crop_bytes=budget.crop_bytes,
        encoder_memory_bytes=budget.reserved_bytes,
    )
    check_encoder_memory(info, [image(2), image(3)])  # 5 crops: fits exactly
    with pytest.raises(ValidationError, match=r"the images need .* MiB to encode \(6 crops\); this server keeps"):
        check_encoder_memory(info, [image(3), image(3)])


def test_images_admitted_together_are_encoded_in_batches_within_the_budget():
    budget = EncoderBudget(crop_values=3 * 32 * 32, crop_bytes=1000, reserved_bytes=5000)
    encoder = ImageEncoder.__new__(ImageEncoder)  # only its batching is looked at here
    encoder.budget = budget
    images = [image(2), image(2), image(3), image(5)]
    assert encoder._within_budget([0, 1, 2, 3], images) == [[0, 1], [2], [3]]
    encoder.budget = None
    assert encoder._within_budget([0, 1, 2, 3], images) == [[0, 1, 2, 3]]


def test_a_patch_sequence_tower_costs_its_whole_sequence():
    """Qwen2-VL's tower has no crop size: the estimate takes the patch count and its own field names."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

    config = Qwen2VLVisionConfig(embed_dim=32, mlp_ratio=2, num_heads=4, depth=1)
    tokens = 100
    assert crop_bytes(config, torch.float32, tokens) == tokens * (6 * 32 + 2 * 64) * 4 + 4 * tokens * tokens * 4
