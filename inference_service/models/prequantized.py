"""Loading a checkpoint stored quantized (GPTQ, AWQ, compressed-tensors) into our quantized linears.

transformers would hand these to quantizer libraries (gptqmodel, autoawq, compressed-tensors) that
need a GPU or are archived. Instead the model is built from its config with uninitialized weights
(no memory is touched for them), each quantized linear's tensors are repacked once into our layout,
and the other tensors (embeddings, norms, an unquantized head) are loaded as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from inference_service.errors import ModelLoadError
from inference_service.worker.kernels.packed import PackedWeight
from inference_service.worker.linears.quant import QuantLinear
from inference_service.worker.linears.replace import replace_module

logger = logging.getLogger(__name__)

# The tensor that marks a linear as stored quantized, per format.
QUANTIZED_MARKERS = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed"}
# (module name, its checkpoint tensors by local name) → (packed weight, input permutation or None).
Converter = Callable[[str, dict[str, torch.Tensor]], "tuple[PackedWeight, torch.Tensor | None]"]


def load_prequantized(
    folder: Path,
    hf_config: Any,
    scheme: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str,
    trust_remote_code: bool,
) -> tuple[torch.nn.Module, int]:
    """The model in `folder` with its quantized linears as `QuantLinear`s; returns (model, count)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    quantization_config = dict(hf_config.quantization_config)
    convert = converter(scheme, quantization_config)
    config = hf_config.__class__.from_dict({k: v for k, v in hf_config.to_dict().items() if k != "quantization_config"})
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
        )
    tensors = _read_safetensors(folder)
    marker = QUANTIZED_MARKERS[scheme]
    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear) or f"{name}.{marker}" not in tensors:
            continue
        own = {key[len(name) + 1 :]: tensors.pop(key) for key in [k for k in tensors if k.startswith(name + ".")]}
        try:
            packed, perm = convert(name, own)
        except (ValueError, KeyError, ModelLoadError) as error:
            raise ModelLoadError(f"could not read the {scheme} weights of {name}: {error}") from None
        bias = own.get("bias")
        replace_module(
            model, name, QuantLinear.from_packed(packed, None if bias is None else bias.float(), input_perm=perm)
        )
        count += 1
    if count == 0:
        raise ModelLoadError(f"the checkpoint in {folder} says {scheme} but holds no {marker} tensors")
    _load_the_rest(model, tensors, dtype, folder)
    return model.to(device).eval(), count


def converter(scheme: str, quantization_config: dict[str, Any]) -> Converter:
    """A function from one linear's checkpoint tensors to its packed weight and input permutation."""
    if scheme in ("gptq", "awq"):
        from inference_service.worker.weights.gptq import packed_from_awq, packed_from_gptq

        bits, group_size = int(quantization_config.get("bits", 4)), int(quantization_config.get("group_size", 128))
        if scheme == "awq":
            version = str(quantization_config.get("version", "gemm")).lower()
            return lambda _name, t: (
                packed_from_awq(
                    t["qweight"], t["qzeros"], t["scales"], bits=bits, group_size=group_size, version=version
                ),
                None,
            )
        sym = bool(quantization_config.get("sym", True))
        checkpoint_format = str(quantization_config.get("checkpoint_format", "gptq"))
        return lambda _name, t: packed_from_gptq(
            t["qweight"],
            t.get("qzeros"),
            t["scales"],
            t.get("g_idx"),
            bits=bits,
            group_size=group_size,
            sym=sym,
            checkpoint_format=checkpoint_format,
        )
    from inference_service.worker.weights.compressed_tensors import (
        packed_from_compressed_tensors,
        scheme_for_module,
        validate_compressed_tensors_config,
    )

    # W8A8 checkpoints also quantize activations, which needs a GPU kernel: here their weights are
    # served with full-precision activations (the log says so).
    validate_compressed_tensors_config(quantization_config, weights_only=True)

    warned: list[str] = []

    def convert(name: str, tensors: dict[str, torch.Tensor]) -> tuple[PackedWeight, None]:
        module_scheme = scheme_for_module(quantization_config, name)
        if module_scheme is None:
            raise ValueError("the checkpoint stores it packed, but no config group targets it")
        if not warned and isinstance(module_scheme, dict) and module_scheme.get("input_activations"):
            warned.append(name)
            logger.warning(
                "the checkpoint quantizes activations too (e.g. %s): served with full-precision activations", name
            )
        return packed_from_compressed_tensors(
            tensors, module_scheme, format=quantization_config.get("format"), weights_only=True
        ), None

    return convert


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"the quantized checkpoint in {folder} has no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 — safe_open is not a mapping
                tensors[key] = handle.get_tensor(key)
    return tensors


def _load_the_rest(model: torch.nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype, folder: Path) -> None:
    """Embeddings, norms and any unquantized linear; every parameter must come from the checkpoint
    (or be tied to one that does)."""
    state = {key: value.to(dtype) if value.is_floating_point() else value for key, value in tensors.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    parameters = list(model.named_parameters(remove_duplicate=False))
    loaded = {tensor.data_ptr() for name, tensor in parameters if name in state}
    missing = [name for name, tensor in parameters if name not in state and tensor.data_ptr() not in loaded]
    if missing:
        raise ModelLoadError(f"the checkpoint in {folder} lacks {len(missing)} tensors, e.g. {missing[0]}")
