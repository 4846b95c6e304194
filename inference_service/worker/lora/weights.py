"""An adapter's weights as the linears use them, and the table of resident adapters.

Weights stay in float whatever the base (fp32, bf16, quantized): the low-rank product is small,
and rounding it to the base's format would change what the adapter computes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

# PEFT's names of the projections an adapter may target (Llama-style layers).
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS

Site = tuple[int, str]  # (layer index, target name): one projection of one decoder layer


@dataclass
class LoraPair:
    """y += (x · a) · b for one projection: a = Aᵀ [in, r], b = scale · Bᵀ [r, out] (float)."""

    a: torch.Tensor  # [in, r]: a view of PEFT's lora_A [r, in], which the native kernel reads
    b: torch.Tensor  # [r, out], the adapter's scale folded in


@dataclass
class AdapterWeights:
    """One loaded adapter: its name, rank and a pair per projection it targets."""

    name: str
    rank: int
    pairs: dict[Site, LoraPair]
    fingerprint: str = ""  # digest of its files: what its K/V depend on besides the tokens
    # The native kernel's table of its sites and the tensors it points into (lora/native.py).
    native_table: tuple[torch.Tensor, list[torch.Tensor]] | None = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size() for p in self.pairs.values())


@dataclass
class LoraTable:
    """The resident adapters by name, as the runner reads them each step (swapped whole under a
    lock, so a step never sees half an adapter)."""

    adapters: dict[str, AdapterWeights] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def get(self, name: str) -> AdapterWeights:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise KeyError(f"LoRA adapter {name!r} is not loaded")
        return adapter

    def put(self, adapter: AdapterWeights) -> None:
        with self.lock:
            self.adapters = {**self.adapters, adapter.name: adapter}

    def remove(self, name: str) -> None:
        with self.lock:
            self.adapters = {k: v for k, v in self.adapters.items() if k != name}

    def names(self) -> list[str]:
        return list(self.adapters)
