"""The order configs' context lengths are read in, and TGI's default max_total_tokens from it."""

from __future__ import annotations

import logging

import pytest
from transformers import AutoConfig, LlavaConfig, PretrainedConfig

from inference_service.models.context import CONTEXT_FIELDS, default_max_total_tokens, stated_context_length


@pytest.mark.parametrize("index", range(len(CONTEXT_FIELDS)))
def test_the_first_stated_field_wins(index):
    # Every field from `index` on is stated, each with its own value: the earliest one is read.
    stated = {name: 100 + i for i, name in enumerate(CONTEXT_FIELDS) if i >= index}
    assert stated_context_length(PretrainedConfig(**stated)) == 100 + index


@pytest.mark.parametrize("value", [None, 0, -1, True, "2048", 2048.0])
def test_values_that_are_no_length_are_skipped(value):
    assert stated_context_length(PretrainedConfig(max_position_embeddings=value, n_ctx=300)) == 300
    assert stated_context_length(PretrainedConfig(max_position_embeddings=value)) is None


@pytest.mark.parametrize(
    ("model_type", "fields", "expected"),
    [
        ("bloom", {}, None),
        ("t5", {}, None),
        ("t5", {"n_positions": 512}, 512),
        ("mpt", {"max_seq_len": 2048}, 2048),
        ("gpt2", {"n_positions": 1024}, 1024),  # through the config's attribute_map
        ("llama", {"max_position_embeddings": 8192}, 8192),
    ],
)
def test_transformers_configs(model_type, fields, expected):
    assert stated_context_length(AutoConfig.for_model(model_type, **fields)) == expected


def test_a_multimodal_configs_text_config_is_read():
    config = LlavaConfig(text_config={"model_type": "llama", "max_position_embeddings": 2048})
    assert stated_context_length(config) == 2048


def test_tgis_default(caplog):
    with caplog.at_level(logging.INFO, logger="inference_service.models.context"):
        assert default_max_total_tokens(None) == 4096  # `unwrap_or(4096)`
        assert default_max_total_tokens(2048) == 2048
        assert default_max_total_tokens(4096) == 4096
        assert caplog.records == []
        assert default_max_total_tokens(32768) == 4096
    assert [r.getMessage() for r in caplog.records] == [
        "Model supports up to 32768 but tgi will now set its default to 4096 instead. This is to save VRAM by "
        "refusing large prompts in order to allow more users on the same hardware. You can increase that size "
        "using `--max-batch-prefill-tokens=32818 --max-total-tokens=32768 --max-input-tokens=32767`."
    ]
