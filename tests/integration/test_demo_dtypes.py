"""`--dtype bfloat16` and `--dtype float16` on CPU: the demo model served in that dtype (weights and
KV cache) gives transformers' own greedy output in the same dtype.

Exact agreement is not promised in 16 bits: transformers' own attention implementations (eager
and SDPA) disagree by up to 0.69 in a logit in bf16 and 0.09 in fp16 on the demo model. So each
generated token must be transformers' argmax, or, at the first token where the two differ, a
near-tie in transformers' own logits (its top logit within that tolerance of ours); the rest of a
diverged output is not compared. On these prompts both dtypes agree token for token today.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig
from inference_service.engine.builder import build_engine
from inference_service.models.demo import ensure_demo_model
from inference_service.worker.kernels.bf16_glue import BF16DecodeGlue
from inference_service.worker.linears.bf16 import BF16NativeLinear
from tests.conftest import greedy_token_ids

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
NEW_TOKENS = 12
# How far transformers' eager and SDPA attention put a logit apart on the demo model, per dtype.
NEAR_TIE = {torch.bfloat16: 0.75, torch.float16: 0.1}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_demo_model_in_16_bits_greedy_matches_transformers_in_the_same_dtype(dtype):
    folder = ensure_demo_model()
    name = str(dtype).removeprefix("torch.")
    engine = build_engine(
        EngineConfig(
            model=ModelConfig(model_id=str(folder), dtype=name, device="cpu"),
            cache=CacheConfig(max_batch_total_tokens=1024),
            limits=LimitsConfig(max_total_tokens=512),
        )
    )
    assert engine.info.dtype == name
    assert engine.runner.kv_cache.keys[0].dtype == engine.runner.kv_cache.values[-1].dtype == dtype
    assert {p.dtype for p in engine.runner.model.parameters()} == {dtype}
    if dtype == torch.bfloat16:  # decode steps: bf16 weights, glue and attention through the native kernels
        assert isinstance(engine.runner.model.lm_head, BF16NativeLinear)
        assert engine.runner.decode_kernel is not None and engine.runner.decode_step is not None
        assert isinstance(engine.runner.decode_step.ops.glue, BF16DecodeGlue)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    for prompt in PROMPTS:
        ours = greedy_token_ids(engine, prompt, NEW_TOKENS)
        prompt_ids = engine.tokenizer(prompt)["input_ids"]
        with torch.inference_mode():  # transformers' logits along our output, in one pass
            logits = reference(torch.tensor([prompt_ids + ours])).logits[0, len(prompt_ids) - 1 : -1].float()
        assert len(ours) == NEW_TOKENS
        for step, token in enumerate(ours):
            best = int(logits[step].argmax())
            if token != best:
                gap = (logits[step, best] - logits[step, token]).item()
                assert gap <= NEAR_TIE[dtype], f"{prompt!r} step {step}: {token} is {gap} below {best}"
                break
