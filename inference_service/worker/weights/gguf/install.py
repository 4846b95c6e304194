"""Putting packed weights into a loaded model: each named linear becomes a `QuantLinear`.

For a GGUF file whose output head is the token embedding (no `output.weight`, as llama.cpp ties
them), the head is packed from the quantized `token_embd` too: llama.cpp multiplies by that
quantized matrix, and the head is the largest matrix a small model reads per token. The embedding
lookup keeps its fp32 copy.
"""

from __future__ import annotations

import logging
import os
from typing import Any, cast

import torch
from gguf import GGUFReader

from inference_service.worker.kernels.packed import PackedWeight
from inference_service.worker.linears.quant import QuantLinear
from inference_service.worker.linears.replace import replace_module
from inference_service.worker.weights.at_load import float_bias
from inference_service.worker.weights.gguf.blocks import is_supported_type, packed_from_gguf
from inference_service.worker.weights.gguf.weights import gguf_linear_weights

logger = logging.getLogger(__name__)


def install_packed(model: torch.nn.Module, packed: dict[str, PackedWeight]) -> int:
    """Replace each named linear by a `QuantLinear` over its packed weight (bias kept); returns the count."""
    for name, weight in packed.items():
        linear = cast(torch.nn.Linear, model.get_submodule(name))  # `packed` names the model's linears
        replace_module(model, name, QuantLinear.from_packed(weight, float_bias(linear)))
    return len(packed)


def install_gguf(model: torch.nn.Module, gguf_path: str | os.PathLike) -> int:
    """`--quantize gguf`: the file's quantized tensors for the model's linears, the tied head included."""
    reader = GGUFReader(os.fspath(gguf_path), "r")  # one header parse for both lookups
    packed = gguf_linear_weights(gguf_path, model, reader)
    head = _tied_head(model, reader)
    if head is not None:
        packed[head[0]] = head[1]
    return install_packed(model, packed)


def _tied_head(model: Any, reader: GGUFReader) -> tuple[str, PackedWeight] | None:
    # model: a transformers PreTrainedModel, whose attributes torch types as tensors
    output, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if not isinstance(output, torch.nn.Linear) or output.weight.data_ptr() != embeddings.weight.data_ptr():
        return None
    tensors = {t.name: t for t in reader.tensors}
    token_embd = tensors.get("token_embd.weight")
    if "output.weight" in tensors or token_embd is None or not is_supported_type(token_embd.tensor_type):
        return None
    shape = (int(token_embd.shape[1]), int(token_embd.shape[0]))  # GGUF's ne is [K, N]
    if shape != tuple(output.weight.shape):
        return None
    name = next(n for n, module in model.named_modules() if module is output)
    logger.info("the output head is the GGUF's %s token embedding, packed", token_embd.tensor_type.name)
    return name, packed_from_gguf(token_embd.data, token_embd.tensor_type, shape)
