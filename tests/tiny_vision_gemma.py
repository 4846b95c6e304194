"""Tiny random PaliGemma and Gemma 3 models (SigLIP vision tower, Gemma text model), saved with a
tokenizer and the model's own processor as a model folder the server loads (no hub). Both attend
both ways over image tokens: PaliGemma over its whole prompt (prefix-LM), Gemma 3 within each image."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_vision import vision_tokenizer

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
# One user/assistant conversation, each image part written as the processor's placeholder.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + BOI + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}</turn>\n{% endfor %}{% if add_generation_prompt %}<turn>model\n{% endif %}"
)
PALIGEMMA_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
)


def _siglip(image_size: int = 32):
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=8,
    )


def _spread_projector(module: torch.nn.Module) -> None:
    """Spread the projector wide so image content moves the greedy choices."""
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.5)


def save_gemma3(folder: str | Path, seed: int = 0, sliding_window: int = 8) -> Path:
    """A tiny random Gemma 3 (4 tokens per 32x32 image, sliding-window and global layers)."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
        Gemma3TextConfig,
        PreTrainedTokenizerFast,
    )

    folder = Path(folder)
    base = vision_tokenizer((BOI, EOI, SOFT))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": SOFT},
    )
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=_siglip(),
        mm_tokens_per_image=4,
        boi_token_id=tokenizer.boi_token_id,
        eoi_token_id=tokenizer.convert_tokens_to_ids(EOI),
        image_token_id=tokenizer.image_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    _spread_projector(model.model.multi_modal_projector)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
        image_seq_length=4,
        chat_template=GEMMA3_TEMPLATE,
    )
    processor.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_paligemma(folder: str | Path, seed: int = 0) -> Path:
    """A tiny random PaliGemma (16 tokens per 32x32 image, Gemma text model)."""
    from transformers import (
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        SiglipImageProcessorPil,
    )

    folder = Path(folder)
    tokenizer = vision_tokenizer(("<image>",))
    text = GemmaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = PaliGemmaConfig(
        text_config=text,
        vision_config=_siglip(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        projection_dim=64,
        tie_word_embeddings=False,
    )
    config.vision_config.projection_dim = 64
    torch.manual_seed(seed)
    model = PaliGemmaForConditionalGeneration(config).eval()
    _spread_projector(model.model.multi_modal_projector)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    image_processor = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    image_processor.image_seq_length = 16
    processor = PaliGemmaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=PALIGEMMA_TEMPLATE
    )
    processor.save_pretrained(folder)
    processor.tokenizer.save_pretrained(folder)
    return folder
