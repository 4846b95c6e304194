"""PaliGemma counts positions from 1: its `generate` adds 1 to the position ids, and its forward
does when it makes them itself. The paged runner passes positions from 0, so they are shifted here,
once for every forward that is given them."""

from __future__ import annotations

from typing import Any

import torch


def shift_positions(model: torch.nn.Module) -> None:
    """Make `model` (a PaliGemmaForConditionalGeneration) read the runner's positions as its own."""

    def one_based(_module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        positions = kwargs.get("position_ids")
        if positions is not None:
            kwargs = {**kwargs, "position_ids": positions + 1}
        return args, kwargs

    model.register_forward_pre_hook(one_based, with_kwargs=True)


def adapt_vision_model(model: torch.nn.Module) -> None:
    """A loaded vision-language model's family quirks the paged runner must honour."""
    if getattr(model.config, "model_type", None) == "paligemma":
        shift_positions(model)
