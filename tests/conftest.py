"""Shared fixtures."""

from __future__ import annotations

import random

import pytest

_TEXT = ("the quick brown fox jumps over a lazy dog and then runs home again while birds sing "
         "café naïve résumé Grüße Ελληνικά Привет мир ¿Qué? 日本語 東京 こんにちは 世界 中文 "
         "😀 🎉 👍🏽 🇯🇵 ✨ <tag> 1234 3.14 , . ! ?")


@pytest.fixture(scope="session")
def byte_tokenizer():
    """A real byte-level BPE tokenizer (GPT-2 style) trained here on a few hundred lines.

    Special: <|startoftext|> (BOS, added to each encoding), <|endoftext|> (EOS), <|pad|>,
    <|im_start|>, <|im_end|>. <|tool|> is an added token that is NOT special.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    lines = [" ".join(rng.choices(_TEXT.split(), k=rng.randint(3, 12))) for _ in range(400)]
    specials = ["<|startoftext|>", "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=330, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A", special_tokens=[("<|startoftext|>", backend.token_to_id(specials[0]))])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=specials[0], eos_token=specials[1], pad_token=specials[2],
        additional_special_tokens=specials[3:])
    tokenizer.add_tokens(["<|tool|>"])
    return tokenizer


TINY_MODEL_MAX_POSITIONS = 512


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, byte_tokenizer):
    """A folder holding a tiny random Llama (safetensors) and the byte tokenizer: a model the
    server loads like any local model. Weights are seeded and spread wide (initializer_range)
    so greedy choices are not near-ties that float noise could flip."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(byte_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TINY_MODEL_MAX_POSITIONS,
        initializer_range=0.1, bos_token_id=byte_tokenizer.bos_token_id,
        eos_token_id=byte_tokenizer.eos_token_id, pad_token_id=byte_tokenizer.pad_token_id,
        tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    byte_tokenizer.save_pretrained(folder)
    return folder
