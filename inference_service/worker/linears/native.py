"""Routes a model's projections through the native linear kernels: a few rows (decode steps) to
the few-row kernel, more (prefill, large batches) to the panel GEMM.

`install` switches the class of each plain `nn.Linear` whose weight the kernels take to
`NativeLinear`: same parameters (tied weights stay tied), same state dict, and a product that
needs autograd, or an input wider than the panel GEMM takes, still goes to torch's GEMM.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from inference_service.worker.kernels.bindings import MAX_LINEAR_ROWS, PanelLinear, SmallBatchLinear

KERNELS = ("native_kernel", "panel_kernel")  # the instance attributes install() sets


class NativeLinear(torch.nn.Linear):
    """An `nn.Linear` whose forward sends at most MAX_LINEAR_ROWS rows to the few-row kernel and more
    to the panel GEMM (when there is one)."""

    native_kernel: SmallBatchLinear
    panel_kernel: PanelLinear | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and not torch.is_grad_enabled():
            if x.numel() <= MAX_LINEAR_ROWS * self.in_features:
                return self.native_kernel(x, self.weight, self.bias)
            if self.panel_kernel is not None and self.panel_kernel.takes(self.in_features):
                return self.panel_kernel(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def install(model: torch.nn.Module, kernel: SmallBatchLinear, panel: PanelLinear | None = None) -> int:
    """Switch the model's eligible linears to NativeLinear; returns how many were switched."""
    switched = 0
    for module in model.modules():
        bias = module.bias if type(module) is torch.nn.Linear else None
        if (
            type(module) is torch.nn.Linear
            and kernel.supports_weight(module.weight)
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
        ):
            module.__class__ = NativeLinear
            switched_module = cast(NativeLinear, module)  # the same object, now of the class just set
            switched_module.native_kernel, switched_module.panel_kernel = kernel, panel
            switched += 1
    return switched
