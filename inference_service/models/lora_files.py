"""Reading LoRA adapters in PEFT's on-disk format: `adapter_config.json` + `adapter_model.safetensors`.

Every way an adapter can be wrong for the base model (missing or corrupt files, a rank over
`--max-lora-rank`, shapes that are not the base's, targets or options we do not apply) is an
`AdapterError` whose one line names the adapter and what is wrong. Nothing is partly applied:
an adapter is read whole, checked, then handed over.

What we apply, as PEFT computes it: for each targeted projection, `y += scale · (x · Aᵀ) · Bᵀ`,
scale `lora_alpha / r` (`lora_alpha / √r` with `use_rslora`). Targets are the Llama-style
q/k/v/o and gate/up/down projections.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from inference_service.worker.lora.weights import TARGETS, AdapterWeights, LoraPair, Site

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT's saved keys; the adapter's
# own name, `.default`, is dropped when saved, but tolerated).
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
# PEFT options that change what a LoRA layer computes (or what it targets) beyond A and B.
_OFF_OPTIONS = (
    "fan_in_fan_out",
    "lora_bias",
    "layer_replication",
    "trainable_token_indices",
    "target_parameters",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
)
_PARENT = {t: ("self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp") for t in TARGETS}


class AdapterError(ValueError):
    """An adapter that can't be served; the message names it and says why."""


def parse_adapter_specs(spec: str | None) -> list[tuple[str, str]]:
    """TGI's `--lora-adapters`: comma-separated `name=path` or a bare path / hub id (its own name).
    Returns (name, source) pairs; duplicate or empty names are refused."""
    pairs: list[tuple[str, str]] = []
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, _, source = item.partition("=") if "=" in item else (item, "", item)
        name, source = name.strip(), source.strip()
        if not name or not source:
            raise AdapterError(f"--lora-adapters: {item!r} is not `name=path` or a path or hub id")
        if name in (n for n, _ in pairs):
            raise AdapterError(f"--lora-adapters names {name!r} twice")
        pairs.append((name, source))
    return pairs


def read_adapter(
    name: str,
    folder: Path,
    shapes: dict[Site, tuple[int, int]],
    max_rank: int,
    device: torch.device,
) -> AdapterWeights:
    """The adapter in `folder`, checked against the base's projection shapes (site → (in, out))."""

    def fail(reason: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {name!r}: {reason}")

    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not folder.is_dir():
        raise fail(f"folder {str(folder)!r} does not exist")
    if not config_path.is_file():
        raise fail(f"no {CONFIG_FILE} in {str(folder)!r} (PEFT's format is expected)")
    if not weights_path.is_file():
        other = " (only safetensors weights are read)" if (folder / "adapter_model.bin").is_file() else ""
        raise fail(f"no {WEIGHTS_FILE} in {str(folder)!r}{other}")
    config_bytes, weights_bytes = config_path.read_bytes(), weights_path.read_bytes()
    try:
        config = json.loads(config_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise fail(f"{CONFIG_FILE} is not valid JSON ({error})") from error
    if not isinstance(config, dict):
        raise fail(f"{CONFIG_FILE} is not a JSON object")
    rank, scale = _check_config(config, max_rank, fail)
    try:
        tensors = load_safetensors(weights_bytes)
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise fail(f"{WEIGHTS_FILE} is not a readable safetensors file ({error})") from error
    pairs = _pairs(tensors, shapes, rank, scale, device, fail)
    fingerprint = hashlib.sha256(config_bytes + b"\0" + weights_bytes).hexdigest()
    return AdapterWeights(name, rank, pairs, fingerprint)


def _check_config(config: dict[str, Any], max_rank: int, fail) -> tuple[int, float]:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise fail(f"peft_type {peft_type!r} is not LORA")
    saved = config.get("modules_to_save") or []
    if saved:
        raise fail(f"modules_to_save ({', '.join(map(str, saved))}) is not supported: only LoRA updates are applied")
    for option, off in (("use_dora", False), ("bias", "none")):
        if config.get(option, off) not in (off, None):
            raise fail(f"{option}={config[option]!r} is not supported")
    for option in ("rank_pattern", "alpha_pattern"):
        if config.get(option):
            raise fail(f"{option} (per-module ranks or alphas) is not supported")
    for option in _OFF_OPTIONS:
        if config.get(option):
            raise fail(f"{option}={config[option]!r} is not supported")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise fail(f"rank r={rank!r} is not a positive integer")
    if rank > max_rank:
        raise fail(f"rank {rank} is more than --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise fail(f"lora_alpha={alpha!r} is not a number")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _pairs(
    tensors: dict[str, torch.Tensor],
    shapes: dict[Site, tuple[int, int]],
    rank: int,
    scale: float,
    device: torch.device,
    fail,
) -> dict[Site, LoraPair]:
    found: dict[Site, dict[str, torch.Tensor]] = {}
    unsupported: set[str] = set()
    num_layers = 1 + max((layer for layer, _ in shapes), default=-1)
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(3) not in _PARENT or _PARENT[match.group(3)] != match.group(2):
            unsupported.add(_module_of(key))
            continue
        layer, target = int(match.group(1)), match.group(3)
        if layer >= num_layers:
            raise fail(f"{key} is for layer {layer}; the base model has {num_layers} layers")
        found.setdefault((layer, target), {})[match.group(4)] = tensor
    if unsupported:
        raise fail(
            f"targets modules that can't be served: {', '.join(sorted(unsupported))} (supported: {', '.join(TARGETS)})"
        )
    if not found:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA weights")
    pairs = {}
    for site, parts in sorted(found.items()):
        where = f"layers.{site[0]}.{_PARENT[site[1]]}.{site[1]}"
        if set(parts) != {"A", "B"}:
            raise fail(f"{where} has lora_{''.join(parts)} but not both lora_A and lora_B")
        a, b = parts["A"], parts["B"]
        fan_in, fan_out = shapes[site]
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise fail(
                f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the base "
                f"(expected [{rank}, {fan_in}] and [{fan_out}, {rank}])"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise fail(f"{where}: the weights are not floating point")
        a32, b32 = a.to(torch.float32), b.to(torch.float32)
        if not (torch.isfinite(a32).all() and torch.isfinite(b32).all()):
            raise fail(f"{where}: the weights hold NaN or infinity")
        pairs[site] = LoraPair(
            a=a32.contiguous().to(device).t(),  # [in, r], stored as [r, in]
            b=(b32.t() * scale).contiguous().to(device),  # [r, out]
        )
    return pairs


def _module_of(key: str) -> str:
    """The module a key belongs to, for messages: `...layers.0.mlp.fc1.lora_A.weight` → `fc1`."""
    stem = key.removesuffix(".weight").split(".")
    for marker in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"):
        if marker in stem:
            return stem[stem.index(marker) - 1]
    return stem[-1] if len(stem) == 1 else stem[-2]
