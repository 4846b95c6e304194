"""Routes a model's few-row projections (decode steps) through the native linear kernel.

`install` switches the class of each plain `nn.Linear` whose weight the kernel takes to
`NativeLinear`: same parameters (tied weights stay tied), same state dict, and any product of
more rows, or one that needs autograd, still goes to torch's GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference_service.worker.cpu_kernels import MAX_LINEAR_ROWS, SmallBatchLinear


class NativeLinear(torch.nn.Linear):
    """An `nn.Linear` whose forward sends at most MAX_LINEAR_ROWS rows to the native kernel."""

    native_kernel: SmallBatchLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.numel() <= MAX_LINEAR_ROWS * self.in_features and x.dtype == torch.float32
                and not torch.is_grad_enabled()):
            return self.native_kernel(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def install(model: torch.nn.Module, kernel: SmallBatchLinear) -> int:
    """Switch the model's eligible linears to NativeLinear; returns how many were switched."""
    switched = 0
    for module in model.modules():
        bias = module.bias if type(module) is torch.nn.Linear else None
        if (type(module) is torch.nn.Linear and kernel.supports_weight(module.weight)
                and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))):
            module.__class__ = NativeLinear
            module.native_kernel = kernel
            switched += 1
    return switched
