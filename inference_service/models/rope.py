"""`--rope-scaling linear|dynamic` and `--rope-factor`: TGI's RoPE scaling, applied to the model config.

TGI's launcher pairs the two flags this way: a scaling without a factor scales by 1.0, a factor
without a scaling is linear, neither leaves the config's own scaling. The chosen scaling replaces the
rotary parameters the checkpoint states (its `rope_theta` is kept), so transformers' rotary
embedding computes it: linear divides positions by the factor; dynamic (NTK-aware) raises the base
once a sequence is longer than the stated context. Dynamic scaling is computed per forward pass from
its longest position (transformers' rotary embedding, as TGI's): the keys of a prompt's early chunks,
prefilled before it grew past the stated context, keep the unscaled rotation.
"""

from __future__ import annotations

from typing import Any


def rope_choice(scaling: str | None, factor: float | None) -> tuple[str, float] | None:
    """(type, factor) from the two flags as TGI's launcher pairs them; None: keep the config's."""
    if scaling is None and factor is None:
        return None
    return (scaling or "linear", 1.0 if factor is None else factor)


def apply_rope_scaling(config: Any, choice: tuple[str, float] | None) -> None:
    """Set the (text) config's rotary scaling to `choice` in place; None changes nothing."""
    if choice is None:
        return
    rope_type, factor = choice
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    stated = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    parameters = {"rope_theta": getattr(text, "rope_theta", None), **dict(stated)}
    if parameters["rope_theta"] is None:
        parameters.pop("rope_theta")
    parameters.update(rope_type=rope_type, factor=float(factor))
    if hasattr(text, "rope_parameters"):
        text.rope_parameters = parameters
    else:  # configs from before transformers 5 name it rope_scaling
        text.rope_scaling = parameters
