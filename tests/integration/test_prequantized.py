"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) written from the tiny model load with no
flag and generate what a full-precision twin carrying the same dequantized weights generates."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inference_service.config import ModelConfig
from inference_service.engine.builder import build_engine
from inference_service.errors import ModelLoadError
from inference_service.worker.linears.quant import QuantLinear
from tests.conftest import copy_linear_weight, greedy_token_ids
from tools.checkpoint_writers import write_checkpoint

VARIANTS = {
    "gptq-4bit-g32": {"format": "gptq", "bits": 4, "group_size": 32},
    "gptq-8bit-v2": {"format": "gptq", "bits": 8, "group_size": 32, "checkpoint_format": "gptq_v2"},
    "gptq-act-order": {"format": "gptq", "bits": 4, "group_size": 32, "desc_act": True},
    "awq-gemm": {"format": "awq", "bits": 4, "group_size": 32},
    "compressed-tensors-int4": {"format": "compressed-tensors", "bits": 4, "group_size": 32},
}


def _config(base, model_id, quantize=None):
    return dataclasses.replace(base, model=dataclasses.replace(base.model, model_id=str(model_id), quantize=quantize))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_checkpoint_loads_without_a_flag_and_matches_its_twin(tiny_engine_config, tmp_path, variant):
    options = VARIANTS[variant]
    folder = tmp_path / variant
    write_checkpoint(tiny_engine_config.model.model_id, folder, **options)
    quantized = build_engine(_config(tiny_engine_config, folder))
    assert quantized.info.quantize == options["format"]
    twin = build_engine(tiny_engine_config)
    swapped = 0
    with torch.no_grad():
        for name, module in quantized.runner.model.named_modules():
            if isinstance(module, QuantLinear):
                weight = module.packed.dequantize()  # [N, K] over the permuted inputs with act-order
                if module.input_perm is not None:
                    weight = torch.empty_like(weight).index_copy_(1, module.input_perm, weight)
                copy_linear_weight(twin.runner.model.get_submodule(name), weight)
                swapped += 1
    assert swapped == 7 * quantized.runner.model.config.num_hidden_layers  # every decoder projection
    assert greedy_token_ids(quantized) == greedy_token_ids(twin)


def test_a_flag_that_contradicts_the_checkpoint_is_refused(tiny_engine_config, tmp_path):
    write_checkpoint(tiny_engine_config.model.model_id, tmp_path / "gptq", format="gptq", bits=4, group_size=32)
    with pytest.raises(ModelLoadError, match="already quantized with gptq"):
        build_engine(_config(tiny_engine_config, tmp_path / "gptq", quantize="awq"))
    assert ModelConfig(quantize="gptq").quantize == "gptq"
