"""Tiny random Qwen2-VL and Qwen2.5-VL models, saved with a tokenizer and the family's own
processor (its PIL image processor: no torchvision) as a model folder the server loads (no hub)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_vision import vision_tokenizer

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
# Qwen2-VL's conversation format, as its processor's chat template writes it (system turn left out).
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PATCH, MERGE = 4, 2  # 4x4-pixel patches, 2x2 of them merged per image token: 8x8 pixels per token


def save_qwen_vl(folder: str | Path, family: str = "qwen2_vl", seed: int = 0, num_layers: int = 2) -> Path:
    """A tiny random Qwen2-VL (`family="qwen2_vl"`) or Qwen2.5-VL (`"qwen2_5_vl"`): a 40x30 image
    is resized to 40x32 and becomes 5x4 = 20 image tokens, placed with 3-D rotary positions."""
    from transformers import Qwen2VLImageProcessorPil

    from inference_service.models.qwen_vl_processor import image_only_processor_class

    folder = Path(folder)
    tokenizer = vision_tokenizer(("<|im_start|>", "<|im_end|>", VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD))
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in (VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)}
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(depth=2, hidden_size=32, num_heads=4, patch_size=PATCH, spatial_merge_size=MERGE)
    tokens = dict(
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
    )
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        config = Qwen2VLConfig(text_config=text, vision_config={**vision, "embed_dim": 32, "hidden_size": 64}, **tokens)
        model_class = Qwen2VLForConditionalGeneration
    elif family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        vision_25 = {**vision, "intermediate_size": 64, "out_hidden_size": 64, "window_size": 16}
        config = Qwen2_5_VLConfig(text_config=text, vision_config={**vision_25, "fullatt_block_indexes": [1]}, **tokens)
        model_class = Qwen2_5_VLForConditionalGeneration
    else:
        raise ValueError(f"not a Qwen VL family: {family}")
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # spread the merger wide so image content moves the greedy choices
        for parameter in model.model.visual.merger.parameters():
            parameter.normal_(0.0, 0.5)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=8 * 8, max_pixels=64 * 64, patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2
    )
    processor_class = image_only_processor_class()
    processor = processor_class(image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN_VL_TEMPLATE)
    processor.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
