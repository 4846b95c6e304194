"""Models TGI serves with no length flags start here with TGI's limits: the context length the config
states (BLOOM none, MPT `max_seq_len`, T5 checkpoints `n_positions`), at most 4096, 4096 when it
states none; max_input_tokens one less. Tiny random checkpoints behind the real gRPC server, read
back from Info (what REST /info answers)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference_service.config import CacheConfig, EngineConfig, ModelConfig
from tests.tiny_seq2seq import save_model, seq2seq_config
from tests.unit.tiny_models import tiny_config
from textgen.v1 import generate_pb2 as pb

# (family, what its config states, TGI's max_total_tokens for it)
CASES = [
    ("bloom", {}, 4096),  # ALiBi: no context length stated
    ("mpt", {"max_seq_len": 2048}, 2048),  # MPT-7B's
    ("mpt", {"max_seq_len": 8192}, 4096),  # MPT-7B-8k's: more than TGI's default
    ("t5", {"n_positions": 512}, 512),  # as t5-small's config.json states it
]


def _checkpoint(folder, family: str, stated: dict, tokenizer):
    special = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if family == "t5":
        return save_model(seq2seq_config("t5", tokenizer, **stated), tokenizer, folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **special, **stated), dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(("family", "stated", "expected"), CASES, ids=[f"{f}-{s or 'none'}" for f, s, _ in CASES])
def test_no_length_flags_give_tgis_defaults(
    family, stated, expected, tmp_path, byte_tokenizer, start_grpc_server, caplog
):
    folder = _checkpoint(tmp_path, family, stated, byte_tokenizer)
    # The KV cache size is fixed so the test does not depend on the machine's memory; it holds more
    # than any default, so the default is the model's, not the cache's.
    config = EngineConfig(
        model=ModelConfig(model_id=str(folder), device="cpu", dtype="float32"),
        cache=CacheConfig(max_batch_total_tokens=16384),
    )
    with caplog.at_level(logging.INFO, logger="inference_service.models.context"):
        server = start_grpc_server(config)
    info = server.stub.Info(pb.InfoRequest(), timeout=10)
    assert (info.max_total_tokens, info.max_input_tokens) == (expected, expected - 1)
    capped = [r.getMessage() for r in caplog.records if "tgi will now set its default" in r.getMessage()]
    if stated.get("max_seq_len", 0) > 4096:
        assert capped == [
            "Model supports up to 8192 but tgi will now set its default to 4096 instead. This is to save VRAM "
            "by refusing large prompts in order to allow more users on the same hardware. You can increase "
            "that size using `--max-batch-prefill-tokens=8242 --max-total-tokens=8192 --max-input-tokens=8191`."
        ]
    else:
        assert capped == []
