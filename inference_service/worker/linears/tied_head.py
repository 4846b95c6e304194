"""A head tied to the embeddings, stored once in panels: the head runs the panel GEMM, the embedding
gathers its rows from the same panels.

A tied head's weight is the embedding table, so panelled.install leaves it in its rows, and a decode
step's head then ran the few-row kernel, the step's largest single matmul (the vocabulary is most of
a small model). Stored in panels it streams like the other projections: measured on a 2-core Xeon,
2 threads, the ~1.5B shape's head (151,936 x 1,536) 60.1 -> 41.0 ms at 16 rows and 30.2 -> 27.6 ms at
one, the demo model's (49,152 x 576) 7.6 -> 4.8 and 3.7 -> 3.4 ms. Looking a token up reads one
float per 128-byte line (token t is column t % 32 of panel t // 32): 0.02 ms for a 16-token step,
12 ms for a 2,048-token prompt (a plain table: 3 ms), against seconds of prompt compute. The table
is the same floats, held once.
"""

from __future__ import annotations

from typing import Any

import torch

from inference_service.worker.kernels import panels
from inference_service.worker.kernels.bindings import PanelLinear
from inference_service.worker.linears.panelled import PanelledLinear, eligible, parameter_uses


class PanelledEmbedding(torch.nn.Module):
    """nn.Embedding's lookup over a table [V, D] held as `weight_panels` [V/32, D, 32]."""

    weight_panels: torch.Tensor  # a buffer (register_buffer), declared for the type checker

    def __init__(self, weight_panels: torch.Tensor):
        super().__init__()
        count, self.embedding_dim, width = weight_panels.shape
        self.num_embeddings = count * width
        self.register_buffer("weight_panels", weight_panels)

    @property
    def weight(self) -> torch.Tensor:
        """The table [V, D]: a copy, for code that inspects weights."""
        return panels.rows_of(self.weight_panels)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight_panels[input_ids // panels.PANEL, :, input_ids % panels.PANEL]


def install(model: torch.nn.Module, kernel: PanelLinear) -> int:
    """Store a plain embedding and the head tied to it once, in panels; returns 1 if it did, else 0.
    Subclasses (scaled embeddings), vocabulary-parallel shards and a table a third module also uses
    stay as they are."""
    transformers_model: Any = model  # its embedding accessors, which nn.Module does not declare
    names = ("get_input_embeddings", "get_output_embeddings", "set_input_embeddings", "set_output_embeddings")
    if not all(hasattr(transformers_model, name) for name in names):
        return 0
    embed, head = transformers_model.get_input_embeddings(), transformers_model.get_output_embeddings()
    if type(embed) is not torch.nn.Embedding or type(head) is not torch.nn.Linear:
        return 0
    if head.weight is not embed.weight or embed.max_norm is not None or not eligible(head):
        return 0
    if parameter_uses(model)[id(embed.weight)] != 2:
        return 0
    table = panels.panelled(embed.weight.detach())
    transformers_model.set_input_embeddings(PanelledEmbedding(table))
    transformers_model.set_output_embeddings(PanelledLinear(table, head.bias, kernel))
    return 1
