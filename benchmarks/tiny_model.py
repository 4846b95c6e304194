"""A tiny random Llama with a byte-level BPE tokenizer, built locally in a second: the model that
`--quick` runs use, so a smoke run needs no download and finishes fast even on a busy machine.
Its numbers mean nothing; it only proves the scripts run end to end."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

from benchmarks import common

TINY_MODEL_ID = "tiny"
TINY_DIR = common.RAW_DIR / "tiny-llama"
_TEXT = (
    "the quick brown fox jumps over a lazy dog while birds sing in the trees near the river "
    "café naïve 日本語 😀 1234 3.14 , . ! ?"
)


def resolve(model_id: str) -> str:
    """`tiny` becomes the tiny model's folder (built on first use); other ids pass through."""
    return str(ensure_tiny_model()) if model_id == TINY_MODEL_ID else model_id


def ensure_tiny_model(folder: Path = TINY_DIR) -> Path:
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(0)
    lines = [" ".join(rng.choices(_TEXT.split(), k=rng.randint(3, 12))) for _ in range(200)]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        lines,
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", model_max_length=2048)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    return save_once(folder, LlamaForCausalLM(config), tokenizer)


def save_once(folder: Path, model, tokenizer) -> Path:
    """Writes the model and tokenizer to `folder` through a scratch folder renamed into place, so
    runs building the same model at once never see half a folder."""
    scratch = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    model.save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    try:
        scratch.rename(folder)
    except OSError:  # another run built it meanwhile
        shutil.rmtree(scratch, ignore_errors=True)
    return folder
