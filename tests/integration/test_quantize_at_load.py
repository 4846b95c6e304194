"""`--quantize` on the tiny model: which scheme serves, the swap of every linear, and generation that
equals a full-precision twin carrying the same quantized weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inference_service.config import QUANTIZE_SCHEMES, ModelConfig
from inference_service.engine.builder import build_engine
from inference_service.errors import ModelLoadError
from inference_service.worker.weights import schemes
from tests.conftest import copy_linear_weight, greedy_token_ids

PROMPT = "the quick brown fox"


def test_every_flag_value_has_a_scheme_family():
    assert set(QUANTIZE_SCHEMES) == {*schemes.AT_LOAD, *schemes.CHECKPOINT_FORMATS, schemes.GGUF}


@pytest.mark.parametrize(
    ("flag", "stored", "gguf", "expected"),
    [
        (None, None, False, None),
        ("eetq", None, False, "eetq"),
        (None, "gptq", False, "gptq"),
        ("awq", "awq", False, "awq"),
        ("gguf", None, True, "gguf"),
        ("bitsandbytes-nf4", None, True, "bitsandbytes-nf4"),
    ],
)
def test_schemes_resolve_as_tgi(flag, stored, gguf, expected):
    assert schemes.resolve_scheme(flag, stored, is_gguf=gguf) == expected


@pytest.mark.parametrize(
    ("flag", "stored", "gguf", "message"),
    [
        ("eetq", "gptq", False, "already quantized with gptq"),
        ("gptq", None, False, "reads a checkpoint stored in that format"),
        ("gguf", None, False, "must be a .gguf file"),
        (None, "bitsandbytes-nf4", False, "only made while loading"),
    ],
)
def test_contradictions_are_clear_errors(flag, stored, gguf, message):
    with pytest.raises(ModelLoadError, match=message):
        schemes.resolve_scheme(flag, stored, is_gguf=gguf)


def test_checkpoint_schemes_come_from_quantization_config():
    assert schemes.checkpoint_scheme({"quant_method": "gptq", "bits": 4}) == "gptq"
    assert schemes.checkpoint_scheme({"quant_method": "bitsandbytes", "load_in_4bit": True}) == "bitsandbytes-nf4"
    with pytest.raises(ModelLoadError, match="can't read"):
        schemes.checkpoint_scheme({"quant_method": "hqq"})


def _with_quantize(config, scheme):
    return dataclasses.replace(config, model=dataclasses.replace(config.model, quantize=scheme))


@pytest.mark.parametrize("scheme", ["eetq", "fp8", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4"])
def test_each_at_load_scheme_serves_and_reports_itself(tiny_engine_config, scheme):
    engine = build_engine(_with_quantize(tiny_engine_config, scheme))
    assert engine.info.quantize == scheme and engine.info.weights_nbytes > 0
    projections = [m for name, m in engine.runner.model.named_modules() if name.endswith(("_proj", "lm_head"))]
    owners = {type(m).__module__.split(".")[0] for m in projections}
    # Every linear swapped, the head included (fp8 keeps torch's linears, with rounded weights).
    assert owners == ({"inference_service"} if scheme in ("eetq", "fp8") else {"bitsandbytes"})
    tokens = greedy_token_ids(engine, max_new_tokens=12)
    assert len(tokens) == 12


def test_eetq_generates_what_its_dequantized_twin_generates(tiny_engine_config):
    """The int8 kernel path against the same int8 weights dequantized into plain fp32 linears."""
    quantized = build_engine(_with_quantize(tiny_engine_config, "eetq"))
    twin = build_engine(tiny_engine_config)
    with torch.no_grad():
        for name, module in quantized.runner.model.named_modules():
            if hasattr(module, "packed"):
                copy_linear_weight(twin.runner.model.get_submodule(name), module.packed.dequantize())
    assert greedy_token_ids(quantized, max_new_tokens=20) == greedy_token_ids(twin, max_new_tokens=20)
    full = build_engine(tiny_engine_config).info.weights_nbytes
    assert quantized.info.weights_nbytes < 0.6 * full  # int8 linears: the tiny model is mostly linears


def test_a_contradicting_flag_fails_the_load(tiny_engine_config):
    config = dataclasses.replace(
        tiny_engine_config, model=ModelConfig(model_id=tiny_engine_config.model.model_id, device="cpu", quantize="gguf")
    )
    with pytest.raises(ModelLoadError, match="gguf"):
        build_engine(config)
