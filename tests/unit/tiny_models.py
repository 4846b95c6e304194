"""Tiny random transformers models, one per architecture, for numerics tests.

Every config has 2 layers, hidden size 64, 4 query heads (2 KV heads where the architecture
has grouped-query attention), a 160-token vocabulary and token ids inside it. Weights are
seeded, and drawn wider than transformers' default (std 0.02) so that attention is peaked
rather than near-uniform: with tiny default weights a wrong mask, window or softcap moves the
logits by less than the tolerance and a test could not tell.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, PretrainedConfig

VOCAB_SIZE = 160
NUM_LAYERS = 2
HIDDEN_SIZE = 64
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
MAX_POSITIONS = 128
INIT_STD = 0.15  # transformers' 0.02 gives near-uniform attention in a 64-wide model

_SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

# Llama-style configs: the same field names; GQA where the architecture supports it.
_LLAMA_STYLE = {
    "hidden_size": HIDDEN_SIZE,
    "intermediate_size": 2 * HIDDEN_SIZE,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": NUM_HEADS,
    "num_key_value_heads": NUM_KV_HEADS,
    "head_dim": HEAD_DIM,
    "max_position_embeddings": MAX_POSITIONS,
    "attention_dropout": 0.0,
}
_GPT2_STYLE = {
    "n_embd": HIDDEN_SIZE,
    "n_layer": NUM_LAYERS,
    "n_head": NUM_HEADS,
    "n_inner": 2 * HIDDEN_SIZE,
    "n_positions": MAX_POSITIONS,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}

_CONFIGS: dict[str, dict] = {
    "llama": _LLAMA_STYLE,
    "mistral": {**_LLAMA_STYLE, "sliding_window": None},
    "qwen2": {**_LLAMA_STYLE, "use_sliding_window": False},
    "qwen3": {**_LLAMA_STYLE, "use_sliding_window": False},
    "gemma": _LLAMA_STYLE,
    # gemma2 always has sliding layers: its default window (4096) is longer than any test sequence.
    "gemma2": {**_LLAMA_STYLE, "query_pre_attn_scalar": HEAD_DIM, "attn_logit_softcapping": None},
    "phi3": {**_LLAMA_STYLE, "sliding_window": None},
    "olmo": _LLAMA_STYLE,
    "stablelm": {**_LLAMA_STYLE, "qk_layernorm": True},
    "gpt2": _GPT2_STYLE,
    "gpt_bigcode": {**_GPT2_STYLE, "multi_query": True},
    "opt": {
        "hidden_size": HIDDEN_SIZE,
        "word_embed_proj_dim": HIDDEN_SIZE,
        "ffn_dim": 2 * HIDDEN_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "max_position_embeddings": MAX_POSITIONS,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "pad_token_id": 1,
        "bos_token_id": 2,
        "eos_token_id": 2,
        "init_std": INIT_STD,
    },
    "gpt_neox": {
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": 2 * HIDDEN_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "max_position_embeddings": MAX_POSITIONS,
    },
    # Architectures the engine refuses; built to prove that it does.
    "bloom": {"hidden_size": HIDDEN_SIZE, "n_layer": NUM_LAYERS, "n_head": NUM_HEADS},
    "falcon": {
        "hidden_size": HIDDEN_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_kv_heads": NUM_HEADS,
        "max_position_embeddings": MAX_POSITIONS,
    },
    "gptj": {
        "n_embd": HIDDEN_SIZE,
        "n_layer": NUM_LAYERS,
        "n_head": NUM_HEADS,
        "rotary_dim": 8,
        "n_inner": 2 * HIDDEN_SIZE,
        "n_positions": MAX_POSITIONS,
    },
    "mpt": {
        "d_model": HIDDEN_SIZE,
        "n_heads": NUM_HEADS,
        "n_layers": NUM_LAYERS,
        "expansion_ratio": 2,
        "max_seq_len": MAX_POSITIONS,
    },
    "t5": {
        "d_model": HIDDEN_SIZE,
        "d_kv": HEAD_DIM,
        "d_ff": 2 * HIDDEN_SIZE,
        "num_layers": NUM_LAYERS,
        "num_decoder_layers": NUM_LAYERS,
        "num_heads": NUM_HEADS,
        "decoder_start_token_id": 0,
    },
}

ARCHITECTURES = tuple(_CONFIGS)


def tiny_config(model_type: str, **overrides) -> PretrainedConfig:
    """A fresh tiny config of `model_type`; `overrides` win over the tiny defaults."""
    fields = {
        "vocab_size": VOCAB_SIZE,
        "initializer_range": INIT_STD,
        **_SPECIAL_IDS,
        **_CONFIGS[model_type],
        **overrides,
    }
    return AutoConfig.for_model(model_type, **fields)


def tiny_model(
    model_type: str | PretrainedConfig, attn_implementation: str = "eager", seed: int = 0, **overrides
) -> torch.nn.Module:
    """A seeded random fp32 causal LM in eval mode.

    Takes a model type (plus config overrides) or a config, which is deep-copied: loading with
    an attention implementation writes it into the config object, and a reference model sharing
    that object would silently switch attention too.
    """
    if isinstance(model_type, PretrainedConfig):
        config = copy.deepcopy(model_type)
    else:
        config = tiny_config(model_type, **overrides)
    auto_class = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    torch.manual_seed(seed)
    model = auto_class.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval()


def same_weights_model(reference: torch.nn.Module, attn_implementation: str) -> torch.nn.Module:
    """A second instance of `reference` (same weights, own config object) with another attention."""
    model = tiny_model(reference.config, attn_implementation=attn_implementation)
    model.load_state_dict(reference.state_dict(), strict=True)
    return model
