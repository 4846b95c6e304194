"""fp32 projections stored in panels (kernels/panels.py), computed by the panel GEMM at every row count.

In a weight's own `[N, K]` rows, the few-row kernel computes dot products, and many rows need each
task's rows packed first. Stored k-major in panels of 32 output rows, every k reads one 128-byte
line of outputs and nothing is packed per call: measured over the demo model's projections
(2 threads), 16 rows 35.5 → 25.5 ms, one row 18.4 → 15.9 ms, and prefill without the packing.

`install` replaces each eligible `nn.Linear` (fp32 on CPU, an output size that fills panels, a
weight no other module shares: a head tied to the embeddings is tied_head.py's) by a
PanelledLinear over the same floats, rearranged once. Its `weight` is then a computed copy, for code
that inspects weights, not for computing or writing (`copy_weight_` writes).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

from inference_service.worker.kernels import panels
from inference_service.worker.kernels.bindings import PanelLinear
from inference_service.worker.linears.replace import replace_module


class PanelledLinear(torch.nn.Module):
    """y = x · Wᵀ + bias with W [N, K] held as `weight_panels` [N/32, K, 32]."""

    # Buffers (register_buffer in __init__), declared for the type checker: nn.Module's
    # __getattr__ types them as `Tensor | Module`.
    weight_panels: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight_panels: torch.Tensor, bias: torch.Tensor | None, kernel: PanelLinear | None):
        super().__init__()
        count, self.in_features, width = weight_panels.shape
        self.out_features = count * width
        self.register_buffer("weight_panels", weight_panels)
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())
        self.kernel = kernel

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, kernel: PanelLinear | None) -> PanelledLinear:
        return cls(panels.panelled(weight.detach()), bias, kernel)

    @property
    def weight(self) -> torch.Tensor:
        """W [N, K]: a copy, so writing into it changes nothing (copy_weight_ does)."""
        return panels.rows_of(self.weight_panels)

    def copy_weight_(self, weight: torch.Tensor) -> None:
        """Overwrite W [N, K] in place (where fusing shares the panels, the fused module sees it too)."""
        self.weight_panels.copy_(panels.panelled(weight.to(self.weight_panels.dtype)))

    def repoint(self, **buffers: torch.Tensor) -> None:
        """Use these tensors (same layout and shapes) as buffers: fusing shares one copy of weights."""
        for name, tensor in buffers.items():
            setattr(self, name, tensor)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.kernel is not None
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and self.weight_panels.device.type == "cpu"
            and not (x.requires_grad and torch.is_grad_enabled())
        ):
            return self.kernel.panels(x, self.weight_panels, self.bias)
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def install(model: torch.nn.Module, kernel: PanelLinear) -> int:
    """Replace the model's eligible linears by PanelledLinear; returns how many were replaced."""
    uses = parameter_uses(model)
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and eligible(module) and uses[id(module.weight)] == 1
    ]
    for name, module in targets:
        replace_module(model, name, PanelledLinear.from_weight(module.weight, module.bias, kernel))
    return len(targets)


def parameter_uses(model: torch.nn.Module) -> Counter[int]:
    """How many modules hold each parameter, by id: a weight two modules share is tied."""
    return Counter(id(parameter) for _, parameter in model.named_parameters(remove_duplicate=False))


def eligible(module: torch.nn.Linear) -> bool:
    weight, bias = module.weight, module.bias
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[0] > 0
        and weight.shape[0] % panels.PANEL == 0
        and weight.shape[1] > 0
        and (bias is None or bias.dtype == torch.float32)
    )
