"""Tiny random encoder-decoders, one per family the engine serves, saved with a tokenizer as a
model folder the server loads like any local model."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM

WIDTH = 64
_BART_STYLE = {
    "d_model": WIDTH,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 2 * WIDTH,
    "decoder_ffn_dim": 2 * WIDTH,
    "max_position_embeddings": 128,
    "init_std": 0.15,
    "dropout": 0.0,
}
_T5_STYLE = {
    "d_model": WIDTH,
    "d_kv": 16,
    "d_ff": 2 * WIDTH,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_heads": 4,
    "initializer_factor": 1.0,
    "dropout_rate": 0.0,
}
# The decoder start each family's checkpoints use: T5 and Marian start from PAD, the BART family from EOS.
FAMILIES = {
    "t5": (_T5_STYLE, "pad"),
    "mt5": (_T5_STYLE, "pad"),
    "umt5": (_T5_STYLE, "pad"),
    "bart": (_BART_STYLE, "eos"),
    "mbart": (_BART_STYLE, "eos"),
    "m2m_100": (_BART_STYLE, "eos"),
    "marian": (_BART_STYLE, "pad"),
    "pegasus": (_BART_STYLE, "pad"),
}


def seq2seq_config(family: str, tokenizer, **overrides):
    """A tiny config of `family` whose special ids are the tokenizer's."""
    fields, start = FAMILIES[family]
    ids = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    ids["decoder_start_token_id"] = ids[f"{start}_token_id"]
    return AutoConfig.for_model(family, **fields, **ids, **overrides)


def save_model(config, tokenizer, folder, seed: int = 0, **generation):
    """A seeded random model of `config` with `tokenizer` in `folder`; `generation` sets generation
    config fields (what `generate` reads, e.g. forced_bos_token_id)."""
    torch.manual_seed(seed)
    model = AutoModelForSeq2SeqLM.from_config(config, dtype=torch.float32).eval()
    for name, value in generation.items():
        setattr(model.generation_config, name, value)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
