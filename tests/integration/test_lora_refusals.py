"""What can't serve LoRA adapters says so at start, in one line: a bad adapter in --lora-adapters,
a model whose layers are not Llama-style, and a model served by the transformers fallback."""

from __future__ import annotations

import dataclasses

import pytest

from inference_service.engine.builder import build_engine
from inference_service.errors import ModelLoadError
from tests.unit.tiny_models import tiny_model


def _with_lora(config, model_id=None, **lora):
    model = dataclasses.replace(config.model, model_id=model_id or config.model.model_id, **lora)
    return dataclasses.replace(config, model=model)


def test_a_bad_adapter_fails_the_start_naming_it(tiny_engine_config, tmp_path):
    with pytest.raises(ModelLoadError, match=r"^LoRA adapter 'x': folder .* does not exist$"):
        build_engine(_with_lora(tiny_engine_config, lora_adapters=f"x={tmp_path / 'missing'}"))
    with pytest.raises(ModelLoadError, match="names 2 adapters, more than --max-loras 1"):
        build_engine(_with_lora(tiny_engine_config, lora_adapters="a=/x,b=/y", max_loras=1))


@pytest.mark.parametrize(
    ("model_type", "message"),
    [
        ("gpt2", "LoRA adapters need Llama-style decoder layers; GPT2LMHeadModel has none"),
        ("bloom", "LoRA adapters are served by the paged runner on decoder-only models; .* transformers' attention"),
    ],
)
def test_models_without_lora_support_refuse_it(tiny_engine_config, byte_tokenizer, tmp_path, model_type, message):
    folder = tmp_path / model_type
    tiny_model(model_type, vocab_size=len(byte_tokenizer)).save_pretrained(folder)
    byte_tokenizer.save_pretrained(folder)
    with pytest.raises(ModelLoadError, match=message):
        build_engine(_with_lora(tiny_engine_config, str(folder), max_loras=2))
