"""A tiny random Mllama (Llama 3.2 Vision's architecture: a tiled vision tower whose output the
language model reads through cross-attention layers), saved with a tokenizer and its own
MllamaProcessor (no hub): images are cut into up to 4 tiles of 32x32."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_vision import vision_tokenizer

IMAGE_TOKEN = "<|image|>"
SPECIALS = (IMAGE_TOKEN, "<|python_tag|>", "<|eot_id|>")
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|eot_id|>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def save_mllama(folder: str | Path, seed: int = 0) -> Path:
    """A tiny random MllamaForConditionalGeneration: 3 text layers, the middle one cross-attention."""
    import transformers as tf

    folder = Path(folder)
    tokenizer = vision_tokenizer(SPECIALS)
    vision = tf.MllamaVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_global_layers=1,
        attention_heads=4,
        image_size=32,
        patch_size=8,
        max_num_tiles=4,
        intermediate_layers_indices=[0, 1],
        vision_output_dim=32 * 3,
    )
    text = tf.MllamaTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        cross_attention_layers=[1],
        max_position_embeddings=2048,
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config = tf.MllamaConfig(
        vision_config=vision, text_config=text, image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    )
    torch.manual_seed(seed)
    model = tf.MllamaForConditionalGeneration(config).eval()
    with torch.no_grad():  # open the cross-attention gates (zero at init) so the image moves the greedy choices
        for name, parameter in model.named_parameters():
            if "cross_attn" in name and name.endswith("gate"):
                parameter.fill_(1.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    image_processor = tf.MllamaImageProcessorPil(size={"height": 32, "width": 32}, max_image_tiles=4)
    processor = tf.MllamaProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=TEMPLATE)
    processor.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
