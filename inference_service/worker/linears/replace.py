"""Swapping one submodule of a model for another by its dotted name: how each runtime linear goes in."""

from __future__ import annotations

import torch


def replace_module(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
