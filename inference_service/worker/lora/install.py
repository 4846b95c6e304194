"""Puts LoRA linears around a model's projections, and gives the decode plan its LoRA sites.

Only when adapters are enabled: a server without them runs the base linears untouched. Every
targetable projection is wrapped, so an adapter loaded later may target any of them.
"""

from __future__ import annotations

from typing import Any

import torch

from inference_service.worker.linears.replace import replace_module
from inference_service.worker.lora.decode import DecodeLora
from inference_service.worker.lora.linear import LoraLinear
from inference_service.worker.lora.weights import ATTENTION_TARGETS, TARGETS, Site


def projection_shapes(model: Any) -> dict[Site, tuple[int, int]]:
    """(in, out) features of every projection an adapter may target, by site; raises ValueError
    naming what is missing when the model's layers are not Llama-style."""
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise ValueError(f"LoRA adapters need Llama-style decoder layers; {type(model).__name__} has none")
    shapes: dict[Site, tuple[int, int]] = {}
    for index, layer in enumerate(layers):
        for target in TARGETS:
            module = _projection(layer, target)
            if module is None:
                raise ValueError(f"LoRA adapters need a {target} in every layer; layer {index} has none")
            shapes[(index, target)] = (int(module.in_features), int(module.out_features))
    return shapes


def _projection(layer: Any, target: str) -> Any:
    owner = getattr(layer, "self_attn" if target in ATTENTION_TARGETS else "mlp", None)
    return getattr(owner, target, None)


def install_lora(model: Any, decode_step: Any = None) -> int:
    """Wrap the model's projections in LoRA linears (prefill and mixed steps) and give the decode plan
    (runner/decode_step.py, when given) its LoRA sites, which it adds itself (lora/decode.py);
    returns how many projections may take an adapter."""
    shapes = projection_shapes(model)
    for index, layer in enumerate(model.model.layers):
        for target in TARGETS:
            owner = "self_attn" if target in ATTENTION_TARGETS else "mlp"
            base = _projection(layer, target)
            replace_module(layer, f"{owner}.{target}", LoraLinear(base, (index, target)))
    if decode_step is not None:
        decode_step.lora = DecodeLora([layer.index for layer in decode_step.layers], shapes)
    return len(shapes)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The base projection under a LoRA linear (the module itself otherwise)."""
    return module.base if isinstance(module, LoraLinear) else module
