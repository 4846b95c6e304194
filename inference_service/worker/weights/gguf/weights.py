"""A GGUF file's quantized tensors as the packed weights of a transformers model's `nn.Linear`s.

The model is the one built from the GGUF's converted folder (see `convert.py`),
whose fp32 weights transformers' `load_gguf_checkpoint` produced: each GGUF tensor was dequantized,
passed through the architecture's tensor processor (e.g. Llama's reverse permutation of attn_q/attn_k
rows) and stored under the name `get_gguf_hf_weights_map` gives it. Here the same name map and
processor are reused, but the processor runs on index probes instead of weights: a processor that
only reorders rows can be replayed on packed rows exactly (every row carries its own groups);
anything else (transposes, arithmetic, tensors it splits or stores itself) leaves that weight dense.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from gguf import GGUFReader

from inference_service.worker.kernels.packed import PackedWeight
from inference_service.worker.weights.gguf.blocks import is_quantized_type, is_supported_type, packed_from_gguf

logger = logging.getLogger(__name__)

# Row/column probes are exact in float32 up to this size (n + 0.5 needs 1 bit below the point).
_FLOAT32_EXACT = 1 << 22


class _Processed(NamedTuple):
    """What the architecture's processor does to one GGUF tensor."""

    name: str | None  # the name it hands on (None: it stored or split the tensor itself)
    rows: np.ndarray | None  # int64 [N]: HF row i is GGUF row rows[i]; None: not a row permutation


def gguf_linear_weights(
    gguf_path: str | os.PathLike, model: torch.nn.Module, reader: GGUFReader | None = None
) -> dict[str, PackedWeight]:
    """`{qualified nn.Linear name: PackedWeight}` for every linear whose GGUF tensor can stay packed.

    `model` is only inspected (module tree, state-dict names, tied parameters): a model on the meta
    device works. A linear is left out (the loader keeps its dense weight) when its tensor is
    F32/F16/BF16, of a quantized type `packed_from_gguf` does not decode, transformed by the
    processor in a way other than a row permutation, or when the linear shares its weight with an
    embedding (tied lm_head: embeddings stay dense). Each packed weight has the HF orientation, so
    `packed.dequantize()` equals the weight transformers loads from the same file. `reader`: the
    file's reader when the caller has one (parsing the header takes seconds for a real vocabulary).
    """
    reader = reader or GGUFReader(os.fspath(gguf_path), "r")  # memory-mapped: tensors are read on use
    processor, name_map = _transformers_processor(gguf_path, reader, model)
    linears = _linear_weight_names(model)
    packed: dict[str, PackedWeight] = {}
    left_dense: dict[str, list[str]] = defaultdict(list)
    for tensor in reader.tensors:
        if not is_quantized_type(tensor.tensor_type) or len(tensor.shape) != 2:
            continue  # dense already, or not a matrix (norms, MoE expert stacks)
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF's ne is [K, N]
        processed = _process_probe(processor, tensor.name, shape, name_map)
        hf_name = name_map.get(processed.name) if processed.name is not None else None
        module_name = linears.modules.get(hf_name) if hf_name is not None else None
        if hf_name is None or module_name is None:
            if hf_name is None or hf_name in linears.tied:
                left_dense[_unmapped_reason(processed, hf_name, linears)].append(tensor.name)
            continue  # an embedding or another non-linear parameter
        reason = _dense_reason(tensor.tensor_type, processed, shape, linears.shapes[hf_name])
        if reason:
            left_dense[reason].append(tensor.name)
            continue
        rows = cast(np.ndarray, processed.rows)  # not None: _dense_reason found no reason
        packed[module_name] = _permute_rows(packed_from_gguf(tensor.data, tensor.tensor_type, shape), rows)
    _log_summary(gguf_path, reader, packed, left_dense, linears)
    return packed


def _transformers_processor(gguf_path, reader, model: torch.nn.Module):
    """The tensor processor and `{gguf name: hf name}` map `load_gguf_checkpoint` uses for this file."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    # The processor gets the config parsed from the GGUF metadata, as in load_gguf_checkpoint.
    config = load_gguf_checkpoint(os.fspath(gguf_path), return_tensors=False)["config"]
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
    with _cached_tensor_name_maps():
        return processor, get_gguf_hf_weights_map(model, processor)


@contextmanager
def _cached_tensor_name_maps() -> Iterator[None]:
    """Build gguf's name map once per (architecture, layers) while mapping a model.

    `get_gguf_hf_weights_map` recurses into every submodule and rebuilds the whole-model map in each
    (4 s for the 135M demo model, growing with layers × modules); the map is a pure function of its
    arguments, and transformers imports it from `gguf` at call time, so caching it there is enough.
    """
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


@dataclass
class _Linears:
    """The model's `nn.Linear`s by HF weight name."""

    modules: dict[str, str] = field(default_factory=dict)  # weight name → module name
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # weight name → [N, K]
    tied: set[str] = field(default_factory=set)  # weight names an embedding owns


def _linear_weight_names(model: torch.nn.Module) -> _Linears:
    """The linears of `model` by weight name; a weight an embedding also uses is tied, not a linear."""
    embedding_weights = {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Embedding)}
    linears = _Linears()
    for module_name, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, torch.nn.Linear):
            continue
        weight_name = f"{module_name}.weight"
        if id(module.weight) in embedding_weights:
            linears.tied.add(weight_name)
            continue
        linears.modules[weight_name] = module_name
        linears.shapes[weight_name] = tuple(module.weight.shape)
    return linears


def _process_probe(processor, name: str, shape: tuple[int, int], name_map: dict[str, str]) -> _Processed:
    """Run the processor on a row-index and a column-index probe and read off what it did.

    Probe values are −(index + 0.5): no index survives arithmetic (−1, log, abs, scaling)
    unchanged, so only pure data movement passes. Row i of the output holding row r of the
    input, all columns in order, is a row permutation; anything else is not.
    """
    n, k = shape
    dtype: type[np.floating[Any]] = np.float32 if max(n, k) < _FLOAT32_EXACT else np.float64
    row_probe = np.broadcast_to(-(np.arange(n, dtype=dtype) + 0.5)[:, None], shape)  # [N, K], read-only
    col_probe = np.broadcast_to(-(np.arange(k, dtype=dtype) + 0.5)[None, :], shape)  # [N, K]
    try:
        by_rows = processor.process(
            weights=row_probe, name=name, tensor_key_mapping=name_map, parsed_parameters={"tensors": {}}
        )
        by_cols = processor.process(
            weights=col_probe, name=name, tensor_key_mapping=name_map, parsed_parameters={"tensors": {}}
        )
    except Exception:  # e.g. it writes in place or needs real values: not a pure reordering
        logger.debug("GGUF tensor processor failed on an index probe of %s", name, exc_info=True)
        return _Processed(name, None)
    if by_rows.name != by_cols.name:
        return _Processed(None, None)
    if by_rows.weights is row_probe and by_cols.weights is col_probe:
        return _Processed(by_rows.name, np.arange(n))  # untouched
    return _Processed(by_rows.name, _rows_of(np.asarray(by_rows.weights), np.asarray(by_cols.weights), shape))


def _rows_of(rows_out: np.ndarray, cols_out: np.ndarray, shape: tuple[int, int]) -> np.ndarray | None:
    """The row permutation that turned the probes into these outputs, or None if it is not one."""
    n, k = shape
    if rows_out.shape != shape or cols_out.shape != shape:
        return None
    source = -rows_out[:, 0].astype(np.float64) - 0.5  # [N]: which input row each output row holds
    columns = -(np.arange(k, dtype=np.float64) + 0.5)
    if not (
        np.array_equal(rows_out, np.broadcast_to(rows_out[:, :1], shape))
        and np.array_equal(cols_out, np.broadcast_to(columns, shape))
        and np.array_equal(np.sort(source), np.arange(n, dtype=np.float64))
    ):
        return None
    return source.astype(np.int64)


def _dense_reason(quant_type, processed: _Processed, shape: tuple[int, int], linear_shape) -> str | None:
    """Why a quantized tensor mapped to a linear stays dense, or None if it can be packed."""
    if not is_supported_type(quant_type):
        return f"type {quant_type.name} has no packed decoder"
    if processed.rows is None:
        return "the transformers tensor processor does more than reorder rows"
    if tuple(linear_shape) != shape:
        return f"its shape {shape} differs from the linear's {tuple(linear_shape)}"
    return None


def _unmapped_reason(processed: _Processed, hf_name: str | None, linears: _Linears) -> str:
    if hf_name in linears.tied:
        return "the linear is tied to an embedding (embeddings stay dense)"
    if processed.name is None:
        return "the transformers tensor processor stores it itself"
    return "transformers maps it to no model parameter"


def _permute_rows(packed: PackedWeight, rows: np.ndarray) -> PackedWeight:
    """`packed` with HF row i taken from GGUF row rows[i] (each row's groups move with it)."""
    if np.array_equal(rows, np.arange(len(rows))):
        return packed

    def take(tensor: torch.Tensor) -> torch.Tensor:  # numpy: torch's uint8 row gather is ~500x slower
        return torch.from_numpy(tensor.numpy()[rows])

    return PackedWeight(
        bits=packed.bits,
        codes=take(packed.codes),
        scales=take(packed.scales),
        offsets=take(packed.offsets),
        group_size=packed.group_size,
        in_features=packed.in_features,
    )


def _log_summary(
    gguf_path, reader, packed: dict[str, PackedWeight], left_dense: dict[str, list[str]], linears: _Linears
) -> None:
    """One line for what stays packed, one per reason something quantized stays dense."""
    types = Counter(
        tensor.tensor_type.name
        for tensor in reader.tensors
        if is_quantized_type(tensor.tensor_type) and len(tensor.shape) == 2
    )
    logger.info(
        "GGUF %s: %d of %d linears kept packed (quantized tensors in the file: %s)",
        os.path.basename(os.fspath(gguf_path)),
        len(packed),
        len(linears.modules),
        ", ".join(f"{count} {name}" for name, count in sorted(types.items())),
    )
    if linears.tied:
        logger.info(
            "GGUF: %s tied to the embedding, which stays dense",
            ", ".join(sorted(name.removesuffix(".weight") for name in linears.tied)),
        )
    for reason, names in left_dense.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        logger.info("GGUF: left dense because %s: %s", reason, shown)
