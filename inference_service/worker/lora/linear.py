"""Linears that add the LoRA update of each row's adapter to the base projection's output.

`LoraLinear` wraps one base projection (any kind: nn.Linear, native, panelled, quantized) for the
steps transformers' layers run (prefill, mixed); the decode plan adds the same updates itself, a
fused projection's parts (q|k|v, gate|up) each in its slice of the output columns (lora/decode.py).
Per group of rows sharing an adapter: shrink (x · A, [n, r]) then expand (· B, [n, out]) and add
into those rows: one native call per projection for every group where the kernel applies
(lora/native.py), else the torch path below (the reference). With no adapter in the step they cost
one contextvar read.

In the torch path the products are small (a few rows times rank 8-64): on CPU they run on one thread. Measured on this
shared 2-core CPU (busy): [2, 64]·[64, 8]·[8, 192] took 44 ms with torch's 2 threads waiting on each
other, 52 µs on one thread (switching included); a step has 7 of them per layer and adapter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from inference_service.worker.lora.batch import LoraStep, current_step
from inference_service.worker.lora.native import NativeParts, add_native, parts_of
from inference_service.worker.lora.weights import Site

# Up to this many rows of x the LoRA products run on one CPU thread (decode steps, short prefills).
SINGLE_THREAD_ROWS = 512


@contextlib.contextmanager
def _one_thread(x: torch.Tensor) -> Iterator[None]:
    threads = torch.get_num_threads()
    if x.device.type != "cpu" or threads == 1 or x.numel() // x.shape[-1] > SINGLE_THREAD_ROWS:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def add_lora(
    x: torch.Tensor, y: torch.Tensor, parts: list[tuple[Site, slice]], native_parts: NativeParts
) -> torch.Tensor:
    """y [..., out] += each group's update of x [..., in] at each part's site, into its columns of y:
    one native call where the kernel applies (lora/native.py), else the torch path per part."""
    step = current_step()
    if step is None:
        return y
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [T, in]
    y2 = y if y.dim() == 2 else y.view(-1, y.shape[-1])  # [T, out]: y is the base's fresh output
    if add_native(x2, y2, step, native_parts):
        return y
    with _one_thread(x):
        for site, columns in parts:
            _add_groups(step, x2, y2[:, columns], site)
    return y


def _add_groups(step: LoraStep, x2: torch.Tensor, y2: torch.Tensor, site: Site) -> None:
    """The torch path (the reference): y2 [T, out] += each group's update of x2 [T, in] at `site`."""
    for group in step.groups:
        pair = group.adapter.pairs.get(site)
        if pair is None:
            continue
        part = x2 if group.rows is None else x2.index_select(0, group.rows)  # [n, in]
        if part.dtype != pair.a.dtype:  # a bf16/fp16 base: the adapter computes in float
            part = part.to(pair.a.dtype)
        if group.rows is None and y2.dtype == pair.b.dtype:
            y2.addmm_(part @ pair.a, pair.b)  # shrink, then expand added in place
            continue
        update = (part @ pair.a) @ pair.b  # [n, out]
        if group.rows is None:
            y2 += update.to(y2.dtype)
        else:
            y2.index_add_(0, group.rows, update.to(y2.dtype))


class LoraLinear(torch.nn.Module):
    """base(x) plus the LoRA update of each row's adapter for this projection."""

    def __init__(self, base: torch.nn.Module, site: Site):
        super().__init__()
        self.base = base
        self.site = site
        shape: Any = base  # every linear kind has in_features and out_features
        self.in_features: int = shape.in_features
        self.out_features: int = shape.out_features
        self.parts = [(site, slice(0, self.out_features))]
        self.native_parts = parts_of([(site, 0, self.out_features)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_lora(x, self.base(x), self.parts, self.native_parts)
