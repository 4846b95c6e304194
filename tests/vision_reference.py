"""transformers' greedy `generate` on the processor outputs an engine request ran: the reference every
vision-language test compares with. Each family only says what its `generate` reads beside the ids
(pixels, grids, token types, masks)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def greedy_reference(folder: str | Path, inputs: Callable[[Any, Any, torch.Tensor], dict]):
    """`generate(request, with_logprobs=False)`: the greedy tokens of the eager model in `folder` (and
    each one's raw logprob); `inputs(model, request, ids)` gives the family's inputs beside the ids."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").eval()

    def generate(request, with_logprobs: bool = False):
        ids = torch.tensor([request.prompt_token_ids])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                **inputs(model, request, ids),
                max_new_tokens=request.stopping.max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        if not with_logprobs:
            return tokens
        steps = zip(out.logits, tokens, strict=True)
        return tokens, [torch.log_softmax(step[0].float(), -1)[token].item() for step, token in steps]

    return generate
