"""The default longest request (prompt + generation) when --max-total-tokens is not given: TGI's rule.

TGI's launcher reads the context length the model's config states (`max_position_embeddings`,
else MPT's `max_seq_len`, else `n_positions`), caps it at 4096 with a log line when the model
allows more ("to save VRAM"), and takes 4096 when the config states none (BLOOM's and T5's
relative positions): `get_max_position_embeddings().unwrap_or(4096)`. The same here, with the
other names configs use for it (`seq_length`, `n_ctx`, `max_sequence_length`); a multimodal model's
text config is read first. The KV cache capacity and the tokenizer's `model_max_length` bound it
further (engine_info.make_info), as TGI's warm-up does.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# In the order they are read: the first one a config states is the model's context length.
CONTEXT_FIELDS = (
    "max_position_embeddings",
    "max_seq_len",  # MPT
    "n_positions",  # GPT-2 style, T5 checkpoints
    "seq_length",  # ChatGLM, Qwen (v1)
    "n_ctx",
    "max_sequence_length",
)
# TGI's `max_default`: the default when the model states more, or nothing.
TGI_MAX_DEFAULT = 4096


def stated_context_length(config) -> int | None:
    """The context length the (transformers) config states, text config first; None: it states none."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for source in (text_config, config):  # the same object twice for text-only models
        for name in CONTEXT_FIELDS:
            value = getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def default_max_total_tokens(stated: int | None) -> int:
    """TGI's default max_total_tokens for a model stating `stated` tokens of context, with TGI's
    launcher line when the model allows more than the default."""
    if stated is None:
        return TGI_MAX_DEFAULT
    if stated > TGI_MAX_DEFAULT:
        logger.info(
            "Model supports up to %d but tgi will now set its default to %d instead. This is to save VRAM by "
            "refusing large prompts in order to allow more users on the same hardware. You can increase that "
            "size using `--max-batch-prefill-tokens=%d --max-total-tokens=%d --max-input-tokens=%d`.",
            stated,
            TGI_MAX_DEFAULT,
            stated + 50,
            stated,
            stated - 1,
        )
        return TGI_MAX_DEFAULT
    return stated
