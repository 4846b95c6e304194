"""`--quantize gguf` end to end on a tiny mixed-type GGUF: the engine serves the file's packed tensors
(the tied head from the quantized token embedding) and generates what the dequantized folder does."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf import digit_splitting_tokenizer
from test_gguf_blocks import TENSOR_TYPES, tiny_llama, write_quantized_gguf

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig
from inference_service.engine.builder import build_engine
from inference_service.worker.linears.quant import QuantLinear
from tests.conftest import greedy_token_ids


@pytest.fixture(scope="module")
def tied_gguf(tmp_path_factory):
    """No output.weight: the head is the Q8_0 token embedding, as in the demo model's file."""
    types = {name: kind for name, kind in TENSOR_TYPES.items() if name != "output.weight"}
    types["token_embd.weight"] = Q.Q8_0
    vocab_size = digit_splitting_tokenizer().get_vocab_size()
    path = tmp_path_factory.mktemp("gguf-serving") / "tiny-tied.gguf"
    return write_quantized_gguf(path, tiny_llama(vocab_size, tied=True), types)


def _engine(path, quantize):
    return build_engine(
        EngineConfig(
            model=ModelConfig(model_id=str(path), device="cpu", quantize=quantize),
            cache=CacheConfig(max_batch_total_tokens=1024),
            limits=LimitsConfig(max_total_tokens=64),
        )
    )


def test_gguf_packed_serving_equals_the_dequantized_folder(tied_gguf):
    packed, dense = _engine(tied_gguf, "gguf"), _engine(tied_gguf, None)
    model = packed.runner.model
    assert packed.info.quantize == "gguf" and dense.info.quantize is None
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.packed.bits == 8  # from token_embd Q8_0
    assert not isinstance(model.model.layers[1].mlp.gate_proj, QuantLinear)  # Q2_K: no decoder, kept dense
    assert packed.info.weights_nbytes < dense.info.weights_nbytes
    with torch.no_grad():  # the head's packed values are the fp32 embedding's, exactly
        assert torch.equal(model.lm_head.packed.dequantize(), dense.runner.model.lm_head.weight)
    assert greedy_token_ids(packed, "12 apples and 3") == greedy_token_ids(dense, "12 apples and 3")
