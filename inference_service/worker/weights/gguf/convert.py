"""Dequantizing a GGUF file into a plain transformers folder (safetensors, float32).

transformers can read a GGUF, but the model it builds refuses `save_pretrained` and its tokenizer
loses some pre-tokenizers. Converting once gives a folder that every loader (ours, transformers 4
and 5) reads like any hub checkpoint, and serving never touches the GGUF again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inference_service import progress
from inference_service.errors import ModelLoadError

logger = logging.getLogger(__name__)

# Written last into a converted folder: its presence means the conversion finished.
CONVERSION_MARKER = "conversion.json"
# Part of a conversion's cache folder name: raised when a fix changes what a file converts to, so a
# conversion made before it is not reused (2: config fields transformers' reader misses; 3: T5's
# feed-forward and output matrix as llama.cpp reads them; 4: the context length of architectures whose
# config has no field for it, BLOOM's).
CONVERTER_VERSION = 4

# Temporary folders older than this are leftovers of a killed conversion or download.
STALE_AFTER_S = 24 * 3600

# llama.cpp pre-tokenizers that split every digit on its own before the GPT-2 regex
# (LLAMA_VOCAB_PRE_TYPE_SMOLLM, _STARCODER, _REFACT); transformers' GGUF reader drops the digit split.
_DIGIT_SPLIT_PRE_TYPES = frozenset({"smollm", "starcoder", "refact"})


def conversion_name(sha256: str) -> str:
    """The cache folder name of the conversion of the GGUF file with this sha256."""
    return f"{sha256}-v{CONVERTER_VERSION}"


def is_converted(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a finished conversion (the marker is written last)."""
    return (Path(folder) / CONVERSION_MARKER).is_file()


def file_sha256(path: str | os.PathLike) -> str:
    """The hex sha256 of a file, read in chunks so a large GGUF never sits in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Dequantize `gguf_path` into a transformers folder at `out_dir` and return `out_dir`.

    The folder is built in a temporary sibling and renamed into place, so an interrupted
    conversion never leaves a folder that looks complete. A finished `out_dir` is returned as is.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file {str(gguf_path)!r} does not exist")
    if is_converted(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_dirs(out_dir.parent, f".{out_dir.name}.partial-*")
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared like the hub's
    try:
        _write_folder(gguf_path, staging)
        _publish(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def remove_stale_dirs(parent: Path, pattern: str, max_age_s: float = STALE_AFTER_S) -> None:
    """Delete temporary folders a killed process left behind; recent ones may still be in use."""
    cutoff = time.time() - max_age_s
    for path in parent.glob(pattern):
        try:
            if path.is_dir() and path.stat().st_mtime < cutoff:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def _write_folder(gguf_path: Path, folder: Path) -> None:
    """Write config, float32 weights, tokenizer and the marker for `gguf_path` into `folder`."""
    try:
        with progress.phase("converting", f"converted {gguf_path.name}", unit="tensor") as phase:
            _write_converted(gguf_path, folder, phase)
    except ModelLoadError:
        raise
    except Exception as error:
        logger.debug("GGUF conversion failed", exc_info=True)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"could not convert GGUF file {gguf_path.name!r}: {reason}") from None


def _write_converted(gguf_path: Path, folder: Path, phase: progress.Phase) -> None:
    with _progress_bars_off(phase):
        metadata = _read_metadata(gguf_path)
        model = _dequantized_model(gguf_path, metadata)
        model.save_pretrained(folder)
        tokenizer = _tokenizer(gguf_path, metadata.get("tokenizer.ggml.pre"))
        context = getattr(model.config, "max_position_embeddings", None)
        if context:  # ALiBi models (BLOOM) state none: --max-total-tokens decides
            tokenizer.model_max_length = context
        tokenizer.save_pretrained(folder)
    _rewrite_json(folder / "config.json", _portable_config)
    _rewrite_json(folder / "tokenizer_config.json", _portable_tokenizer_config)
    _make_readable(folder)
    _write_marker(folder, gguf_path)


def _read_metadata(gguf_path: Path) -> dict:
    """The file's metadata keys, without reading tensor data or the large token arrays."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(gguf_path))
    return metadata


# Metadata llama.cpp writes that transformers' GGUF reader leaves out of the config (which then keeps
# its defaults whatever the file says: Qwen3's head size 128, GPT-2's 1024 positions), and the config
# attribute each fills where the config has it.
_MISSED_KEYS = {
    "attention.key_length": "head_dim",
    "context_length": "n_positions",  # GPT-2 (the reader sets an unused `n_ctx`)
    "feed_forward_length": "n_inner",  # GPT-2 (the reader sets an unused `feed_forward_length`)
    "attn_logit_softcapping": "attn_logit_softcapping",  # Gemma 2
    "final_logit_softcapping": "final_logit_softcapping",
    "decoder_block_count": "num_decoder_layers",  # T5 (the reader gives the decoder the encoder's depth)
}


def _fill_missed_config(config, metadata: dict) -> None:
    architecture = metadata.get("general.architecture")
    for key, attribute in _MISSED_KEYS.items():
        value = metadata.get(f"{architecture}.{key}")
        derived = isinstance(getattr(type(config), attribute, None), property)  # Falcon's head_dim
        if isinstance(value, (int, float)) and attribute in config.to_dict() and not derived:
            setattr(config, attribute, value)
    context = metadata.get(f"{architecture}.context_length")
    if isinstance(context, int) and getattr(config, "max_position_embeddings", None) is None:
        # The reader drops it where the config has no field for it (BLOOM): kept as the length the
        # model states, which the server's default --max-total-tokens reads (models/context.py).
        config.max_position_embeddings = context


def _dequantized_model(gguf_path: Path, metadata: dict) -> Any:  # a transformers PreTrainedModel
    """A fresh float32 model (no `quantization_config`) holding the GGUF's dequantized weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    _fill_missed_config(config, metadata)
    tensors = _tensor_data(gguf_path)
    own_output = _has_own_output_matrix(tensors)
    if config.model_type in ("t5", "umt5"):
        config = _t5_as_llama_cpp_runs_it(config, tensors, own_output)
    auto_class = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    model = auto_class.from_config(config, dtype=torch.float32)
    if own_output:
        _untie_output(model)
    # The same reader `from_pretrained(gguf_file=...)` uses for these architectures: it dequantizes,
    # maps llama.cpp tensor names and undoes llama.cpp's q/k row permutation.
    with _name_map_covering_every_block(config):
        parsed = load_gguf_checkpoint(
            str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
        )
    _load_strict(model, parsed["tensors"])
    return model.eval()


def _tensor_data(gguf_path: Path) -> dict:
    """The file's tensors by llama.cpp name, memory-mapped (nothing is read until used)."""
    from gguf import GGUFReader

    return {tensor.name: tensor for tensor in GGUFReader(str(gguf_path)).tensors}


def _has_own_output_matrix(tensors: dict) -> bool:
    """Whether the file's output matrix is its own, not a stored copy of the token embeddings."""
    output, embeddings = tensors.get("output.weight"), tensors.get("token_embd.weight")
    if output is None or embeddings is None:
        return False
    a, b = output.data, embeddings.data
    if output.tensor_type != embeddings.tensor_type or a.shape != b.shape:
        return True
    rows = max(1, (1 << 24) // max(1, a[0].size))  # compared in slices: the matrices may be GBs
    return not all(np.array_equal(a[i : i + rows], b[i : i + rows]) for i in range(0, len(a), rows))


def _t5_as_llama_cpp_runs_it(config, tensors: dict, own_output: bool):
    """The T5 config llama.cpp runs the file as: a gated GELU feed-forward where the file has gate
    matrices (FLAN-T5, T5 v1.1) and ReLU where it has none (original T5), and the decoder output
    scaled by d_model^-0.5 only when the output matrix is the embeddings (as transformers does for
    tied T5, i.e. not `own_output`). transformers' reader makes every T5 gated."""
    gated = any(".ffn_gate." in name for name in tensors)
    derived = ("is_gated_act", "dense_act_fn", "scale_decoder_outputs", "tie_word_embeddings")
    fields = {key: value for key, value in config.to_dict().items() if key not in derived}
    fields["feed_forward_proj"] = "gated-gelu" if gated else "relu"
    return type(config)(**fields, tie_word_embeddings=not own_output)


def _untie_output(model: Any) -> None:  # a transformers PreTrainedModel
    """Give the output layer its own matrix where the config ties it (transformers 5 ties every T5)."""
    head = model.get_output_embeddings()
    if head is None or head.weight is not model.get_input_embeddings().weight:
        return
    head.weight = torch.nn.Parameter(torch.empty_like(head.weight))
    tied = getattr(model, "all_tied_weights_keys", {})
    for name, module in model.named_modules():
        if module is head:
            tied.pop(f"{name}.weight", None)  # else save_pretrained would drop it as a copy


@contextmanager
def _name_map_covering_every_block(config) -> Iterator[None]:
    """The reader maps block names up to `num_hidden_layers`, which for T5 is the encoder's depth:
    raise it to cover a deeper decoder while the tensors are read."""
    decoder_layers = getattr(config, "num_decoder_layers", None)
    depth = config.num_hidden_layers
    if isinstance(decoder_layers, int) and decoder_layers > depth:
        config.num_hidden_layers = decoder_layers
    try:
        yield
    finally:
        config.num_hidden_layers = depth


def _load_strict(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load `tensors` so that every parameter is set: only tied copies may be absent."""
    result = model.load_state_dict(tensors, strict=False)
    state = model.state_dict()
    loaded_storage = {state[name].data_ptr() for name in tensors if name in state}
    missing = [name for name in result.missing_keys if state[name].data_ptr() not in loaded_storage]
    if missing or result.unexpected_keys:
        raise ModelLoadError(
            f"GGUF tensors don't match the {type(model).__name__} built from its metadata: "
            f"missing {missing[:5]}, unexpected {list(result.unexpected_keys)[:5]}"
        )


def _tokenizer(gguf_path: Path, pre_type: str | None):
    """The GGUF's fast tokenizer, with the digit split restored where llama.cpp applies one."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if pre_type in _DIGIT_SPLIT_PRE_TYPES:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
            ]
        )
    return tokenizer


def _portable_config(config: dict) -> dict:
    """Add the transformers-4 spellings (`rope_theta`, `torch_dtype`) next to the 5.x ones."""
    config.pop("quantization_config", None)
    if config.get("scale_decoder_outputs") is False:  # transformers 4 spells an untied T5 this way
        config["tie_word_embeddings"] = False
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    if "dtype" in config:
        config.setdefault("torch_dtype", config["dtype"])
    return config


def _portable_tokenizer_config(config: dict) -> dict:
    """Name a class both transformers 4 and 5 know (5 writes `TokenizersBackend`); drop load-time keys."""
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for load_time_key in ("is_local", "local_files_only"):
        config.pop(load_time_key, None)
    return config


def _rewrite_json(path: Path, change: Callable[[dict], dict]) -> None:
    """Apply `change` to the JSON object stored at `path`."""
    data = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps(change(data), indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_marker(folder: Path, gguf_path: Path) -> None:
    """Record where the folder came from; written last, it marks the conversion as finished."""
    import transformers

    marker = {
        "source_file": gguf_path.name,
        "source_sha256": file_sha256(gguf_path),
        "weights_dtype": "float32",
        "transformers_version": transformers.__version__,
        "gguf_version": importlib.metadata.version("gguf"),
    }
    (folder / CONVERSION_MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


def _make_readable(folder: Path) -> None:
    """Files readable by all, like the hub cache (some writers create them private)."""
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o644)


def _publish(staging: Path, out_dir: Path) -> None:
    """Rename the finished `staging` folder to `out_dir`; a concurrent identical conversion may win."""
    if out_dir.exists() and not is_converted(out_dir):
        raise ModelLoadError(f"{str(out_dir)!r} exists but is not a finished conversion; remove it and retry")
    try:
        os.rename(staging, out_dir)
    except OSError:
        if not is_converted(out_dir):
            raise
        logger.debug("%s was converted concurrently; keeping that copy", out_dir)


@contextmanager
def _progress_bars_off(phase: progress.Phase) -> Iterator[None]:
    """Silence transformers' bars while converting: the reader's walk over the tensors (a plain
    tqdm that transformers' switch ignores) advances the conversion's own phase instead."""
    from transformers import modeling_gguf_pytorch_utils as reader

    original = reader.tqdm
    reader.tqdm = lambda items, *args, **kwargs: phase.track(items)
    try:
        with progress.library_bars_off():
            yield
    finally:
        reader.tqdm = original
