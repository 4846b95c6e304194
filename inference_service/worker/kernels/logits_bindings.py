"""Binding of the per-row logits statistics (csrc/logits_rows.cpp): each row's first argmax, its
maximum and log(sum(exp(x - max))), one pass of native code where torch takes a max with indices
and a whole log_softmax. The sampler is handed it by the engine (sample/ imports no kernels)."""

from __future__ import annotations

import ctypes

import torch

from inference_service.worker.kernels import native_build
from inference_service.worker.kernels.native_build import I64, POINTER


class LogitsRowStats:
    """logits [B, V] fp32 (CPU) → (first argmax [B] int64, max [B] fp32, log(sum(exp(x - max))) [B] fp32)."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = native_build.bind(library, "logits_row_stats_f32", [POINTER, I64, I64] + [POINTER] * 3)

    @staticmethod
    def takes(logits: torch.Tensor) -> bool:
        return logits.dim() == 2 and logits.dtype == torch.float32 and logits.device.type == "cpu"

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = logits.contiguous()
        rows, vocab = logits.shape
        index = torch.empty(rows, dtype=torch.int64)
        maxes, log_sums = torch.empty(rows), torch.empty(rows)
        if rows and self._fn(logits.data_ptr(), rows, vocab, index.data_ptr(), maxes.data_ptr(), log_sums.data_ptr()):
            raise RuntimeError(f"the logits kernel refused logits {list(logits.shape)}")
        return index, maxes, log_sums


def logits_row_stats_for(device: torch.device) -> LogitsRowStats | None:
    """The native statistics where they apply (CPU) and build; None: the sampler's torch ops."""
    library = native_build.library_for(device, torch.float32)
    return LogitsRowStats(library) if library is not None else None
