"""LoRA adapters served beside the base model, mixed in one batch: every row's greedy tokens and
logprobs equal `peft`'s model with that row's adapter under transformers (1e-4), with requests
of three adapters and the base arriving staggered, chunked prompts, preemption and speculation."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from peft import PeftModel

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig, SchedulerConfig
from inference_service.engine.async_engine import AsyncEngine
from inference_service.engine.builder import build_engine
from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
from tests.engine_calls import idle, validated
from tests.lora_adapters import greedy_reference, make_adapter, peft_model

PROMPTS = [
    "the quick brown fox jumps over the lazy dog " * 2,
    "a",
    "café naïve 日本語 " * 3,
    "1234 3.14 , . ! ? " * 4,
    "birds sing in the morning",
    "the quick brown fox",
]
ADAPTERS = ("alpha", "beta", "gamma")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Three adapters: all seven targets at rank 8; attention only at rank 4 with rsLoRA; the MLP
    only at rank 16."""
    root = tmp_path_factory.mktemp("lora")
    return {
        "alpha": make_adapter(tiny_model_dir, root / "alpha", seed=1),
        "beta": make_adapter(
            tiny_model_dir, root / "beta", seed=2, rank=4, alpha=8, use_rslora=True, targets=ATTENTION
        ),
        "gamma": make_adapter(tiny_model_dir, root / "gamma", seed=3, rank=16, alpha=4, targets=MLP),
    }


@pytest.fixture(scope="module")
def references(tiny_model_dir, adapters):
    models = {None: peft_model(tiny_model_dir, None)}
    models.update({name: peft_model(tiny_model_dir, path) for name, path in adapters.items()})
    return models


def _config(model_dir, adapters, **scheduler) -> EngineConfig:
    spec = ",".join(f"{name}={path}" for name, path in adapters.items())
    return EngineConfig(
        model=ModelConfig(model_id=str(model_dir), device="cpu", dtype="float32", lora_adapters=spec),
        cache=CacheConfig(block_size=4, max_batch_total_tokens=4096),
        scheduler=SchedulerConfig(**{"max_batch_prefill_tokens": 64, **scheduler}),
        limits=LimitsConfig(max_total_tokens=128, max_concurrent_requests=256),
    )


async def _run(engine: AsyncEngine, stagger_s: float, max_new_tokens: int = 12):
    """Every prompt under the base and each adapter, arriving staggered: (adapter, prompt ids, result)."""

    async def one(index: int, adapter: str | None, prompt: str):
        await asyncio.sleep(stagger_s * index)
        params = GenerateParameters(max_new_tokens=max_new_tokens, details=True, adapter_id=adapter)
        request = await validated(engine, GenerateRequest(prompt, params))
        return adapter, request.prompt_token_ids, await engine.generate(request)

    jobs = [(a, p) for p in PROMPTS for a in (None, *ADAPTERS)]
    return await asyncio.gather(*(one(i, a, p) for i, (a, p) in enumerate(jobs)))


def served_runs(built, stagger_s: float = 0.01):
    """`_run` on an engine serving `built`, started before and shut down after."""
    engine = AsyncEngine(built, max_concurrent_requests=64)
    engine.start()

    async def main():
        runs = await _run(engine, stagger_s)
        await engine.shutdown(5.0)
        return runs

    return asyncio.run(main())


_REFERENCE: dict[tuple[str | None, tuple[int, ...]], tuple[list[int], list[float]]] = {}


def _check_against_peft(runs, references, max_new_tokens: int = 12) -> None:
    distinct = set()
    for adapter, prompt_ids, result in runs:
        key = (adapter, tuple(prompt_ids))
        if key not in _REFERENCE:
            _REFERENCE[key] = greedy_reference(references[adapter], prompt_ids, max_new_tokens)
        tokens, logprobs = _REFERENCE[key]
        got = [t.id for t in result.tokens]
        assert got == tokens[: len(got)], (adapter, prompt_ids[:8])
        assert len(got) == max_new_tokens or result.finish_reason.value == "eos_token"
        assert [t.logprob for t in result.tokens] == pytest.approx(logprobs[: len(got)], abs=1e-4)
        distinct.add((adapter, tuple(got)))
    # the adapters really change the outputs: each adapter's tokens differ from the base's somewhere
    for adapter in ADAPTERS:
        base = {tuple(t.id for t in r.tokens) for a, _, r in runs if a is None}
        mine = {tuple(t.id for t in r.tokens) for a, _, r in runs if a == adapter}
        assert mine != base, adapter


@pytest.mark.parametrize(
    ("scheduler", "stagger_s"),
    [
        ({}, 0.0),  # everything in one batch from the start
        ({"max_batch_prefill_tokens": 16}, 0.03),  # staggered, prompts chunked
        ({"speculate": 3}, 0.02),  # guesses verified as decode rows of their request's adapter
    ],
    ids=["batched", "chunked-staggered", "speculate"],
)
def test_each_row_equals_peft_with_its_adapter(tiny_model_dir, adapters, references, scheduler, stagger_s):
    engine = AsyncEngine.from_config(_config(tiny_model_dir, adapters, **scheduler))
    engine.start()

    async def main():
        runs = await _run(engine, stagger_s)
        stats = await idle(engine)
        await engine.shutdown(5.0)
        return runs, stats

    runs, stats = asyncio.run(main())
    _check_against_peft(runs, references)
    assert stats.num_free_blocks + stats.num_cached_blocks >= stats.num_free_blocks  # sanity of the snapshot
    assert engine.stats().num_running == 0


def test_preempted_rows_recompute_with_their_adapter(tiny_model_dir, adapters, references):
    """A KV pool too small for the batch: requests are preempted and recomputed, still exact."""
    config = _config(tiny_model_dir, adapters)
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, max_batch_total_tokens=160))
    engine = AsyncEngine.from_config(config)
    engine.start()

    async def main():
        runs = await _run(engine, 0.0)
        await idle(engine)
        await engine.shutdown(5.0)
        return runs

    runs = asyncio.run(main())
    assert engine.stats().num_preemptions > 0
    _check_against_peft(runs, references)


def test_a_quantized_base_plus_the_float_adapter(tiny_model_dir, adapters):
    """int8 (eetq) base weights with float adapters: each row equals peft's adapter over a float twin
    carrying the same int8 weights, dequantized."""
    config = _config(tiny_model_dir, adapters)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, quantize="eetq"))
    built = build_engine(config)
    twin = peft_model(tiny_model_dir, None)
    num_quantized = 0
    with torch.no_grad():
        for name, module in built.runner.model.named_modules():
            if hasattr(module, "packed"):
                twin.get_submodule(name.removesuffix(".base")).weight.copy_(module.packed.dequantize())
                num_quantized += 1
    assert num_quantized == 2 * 7 + 1  # every projection and the head
    runs = served_runs(built)
    references = {None: twin}
    for name, path in adapters.items():
        reference = peft_model(tiny_model_dir, None)
        reference.load_state_dict(twin.state_dict())
        references[name] = PeftModel.from_pretrained(reference, path).eval()
    _REFERENCE.clear()  # other bases' references must not answer for this one
    try:
        _check_against_peft(runs, references)
    finally:
        _REFERENCE.clear()


def test_one_stream_at_a_time_equals_peft(tiny_model_dir, adapters, references, monkeypatch):
    """Requests one after another: each decode step is one row of one adapter, whose projections and
    updates run as single kernel calls (lora_panel_row_f32) inside the layers' one native call
    (runner/fused_layers.py), still peft's tokens and logprobs."""
    from inference_service.worker.kernels.lora_bindings import load_lora_kernel
    from inference_service.worker.runner.fused_layers import FusedLayers

    if load_lora_kernel() is None:
        pytest.skip("no C++ compiler for the native kernel")
    run = FusedLayers.run
    calls = []

    def counted(self, meta, hidden, cos, sin, lora=None):
        if lora is not None and lora.plan is not None and lora.plan.single is not None:
            calls.append(1)  # one row of one adapter: the panel_row kernel's plan
        return run(self, meta, hidden, cos, sin, lora)

    monkeypatch.setattr(FusedLayers, "run", counted)  # the real call, its one-row adapter steps counted
    engine = AsyncEngine.from_config(_config(tiny_model_dir, adapters))
    engine.start()

    async def main():
        runs = []
        for prompt in PROMPTS[:2]:
            for adapter in (None, *ADAPTERS):
                params = GenerateParameters(max_new_tokens=12, details=True, adapter_id=adapter)
                request = await validated(engine, GenerateRequest(prompt, params))
                runs.append((adapter, request.prompt_token_ids, await engine.generate(request)))
        await engine.shutdown(5.0)
        return runs

    runs = asyncio.run(main())
    _check_against_peft(runs, references)
    assert calls  # the one-row adapter steps took the layers' one call
