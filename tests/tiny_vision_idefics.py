"""A tiny random Idefics3 model (SigLIP-style vision tower, pixel-shuffle connector,
Llama text model), saved with a tokenizer and the model's own processor (no hub): images are split
into 32x32 tiles plus a global image, 4 tokens per tile. SmolVLM is the same layout under its own
classes."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_vision import vision_tokenizer

TILE_TAGS = tuple(f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6))
SPECIALS = ("<image>", "<fake_token_around_image>", "<global-img>", *TILE_TAGS, "<end_of_utterance>")
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def save_idefics3(folder: str | Path, seed: int = 0, family: str = "idefics3") -> Path:
    """A tiny random Idefics3 with its Idefics3Processor (`family="smolvlm"`: a SmolVLM with its
    SmolVLMProcessor, saved as a SmolVLM checkpoint names it)."""
    import transformers as tf

    smol = family == "smolvlm"

    folder = Path(folder)
    tokenizer = vision_tokenizer(SPECIALS)
    text = tf.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = (tf.SmolVLMVisionConfig if smol else tf.Idefics3VisionConfig)(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    config = (tf.SmolVLMConfig if smol else tf.Idefics3Config)(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = (tf.SmolVLMForConditionalGeneration if smol else tf.Idefics3ForConditionalGeneration)(config).eval()
    with torch.no_grad():  # spread the connector wide so image content moves the greedy choices
        for parameter in model.model.connector.parameters():
            parameter.normal_(0.0, 0.5)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    image_processor = (tf.SmolVLMImageProcessorPil if smol else tf.Idefics3ImageProcessorPil)(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True
    )
    if smol:  # its own class needs a video processor (torchvision): the engine's image-only one
        from inference_service.models.smolvlm_processor import image_only_processor_class

        processor_class = image_only_processor_class()
    else:
        processor_class = tf.Idefics3Processor
    processor = processor_class(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4, chat_template=TEMPLATE
    )
    processor.save_pretrained(folder)
    if smol:  # as a real SmolVLM checkpoint names its processor
        saved = folder / "processor_config.json"
        saved.write_text(saved.read_text().replace('"SmolVLMImagesOnlyProcessor"', '"SmolVLMProcessor"'))
    tokenizer.save_pretrained(folder)
    return folder
