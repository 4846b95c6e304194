"""LoRA adapters over quantized bases (GPTQ, AWQ, bitsandbytes NF4): each row of three adapters and
the base, mixed in one batch, equals `peft`'s adapter (in float) over transformers' float model
holding the scheme's dequantized base weights (1e-4 on logprobs, as the fp32 and eetq bases in
test_lora_numerics.py).

The dequantized weights come from outside the serving path: GPTQ and AWQ from the writer's own codes
(so the server's reader and packed kernels are checked too), NF4 from bitsandbytes' own
`dequantize_4bit`. Each served base linear is first checked alone against x · Wᵀ in float64.

The reference models are built from the model folder (a config of their own): a reference built on
the served model's config would share it, and transformers' `from_config(attn_implementation=...)`
rewrites the shared config's attention, switching the served model off the paged KV cache.

GPTQ runs in `make test` (about 10 s); AWQ and NF4 are the same check on other weights, behind
`extended`: `pytest -m extended tests/integration/test_lora_bases.py`.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from inference_service.engine.async_engine import AsyncEngine
from inference_service.engine.builder import build_engine
from inference_service.worker.lora.install import unwrap
from tests.integration.test_lora_numerics import _REFERENCE, ATTENTION, MLP, _check_against_peft, _config, _run
from tests.lora_adapters import make_adapter, peft_model
from tools.checkpoint_writers import write_checkpoint

CHECKPOINTS = {
    "gptq": {"format": "gptq", "bits": 4, "group_size": 32, "desc_act": True},  # act-order: an input permutation
    "awq": {"format": "awq", "bits": 4, "group_size": 32},
}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-bases")
    return {
        "alpha": make_adapter(tiny_model_dir, root / "alpha", seed=11),
        "beta": make_adapter(
            tiny_model_dir, root / "beta", seed=12, rank=4, alpha=8, use_rslora=True, targets=ATTENTION
        ),
        "gamma": make_adapter(tiny_model_dir, root / "gamma", seed=13, rank=16, alpha=4, targets=MLP),
    }


def reference_base(model_dir: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' float model of `model_dir` with these linears' weights (by module name)."""
    model = peft_model(model_dir, None)
    with torch.no_grad():
        for name, weight in weights.items():
            model.get_submodule(name).weight.copy_(weight)
    return model


def assert_served_linears_apply(served: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Each served base linear (under its LoRA wrapper) computes x · Wᵀ (+ bias) of its dequantized
    weight, against float64, at a decode-sized and a prefill-sized row count."""
    generator = torch.Generator().manual_seed(0)
    for name, weight in weights.items():
        linear = unwrap(served.get_submodule(name))
        bias = getattr(linear, "bias", None)
        for rows in (1, 40):
            x = torch.randn(rows, weight.shape[1], generator=generator)
            expected = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
            with torch.inference_mode():
                got = linear(x).double()
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"{name}, {rows} rows")


def serve_and_check(built, base: torch.nn.Module, adapters: dict[str, Path]) -> None:
    """Serve every prompt under the base and each adapter (staggered, in one engine) and check each
    row against peft's adapter over `base`."""
    engine = AsyncEngine(built, max_concurrent_requests=64)
    engine.start()

    async def main():
        runs = await _run(engine, 0.01)
        await engine.shutdown(5.0)
        return runs

    runs = asyncio.run(main())
    references = {None: base}
    for name, path in adapters.items():
        references[name] = PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
    _REFERENCE.clear()  # other bases' references must not answer for this one
    try:
        _check_against_peft(runs, references)
    finally:
        _REFERENCE.clear()


def _prequantized(scheme, tiny_model_dir, tmp_path, adapters) -> None:
    folder = tmp_path / scheme
    written = write_checkpoint(str(tiny_model_dir), folder, **CHECKPOINTS[scheme])
    weights = {name: linear.dequantize() for name, linear in written.items()}
    assert len(weights) == 2 * 7  # every decoder projection; the head stays float
    built = build_engine(_config(folder, adapters))
    assert_served_linears_apply(built.runner.model, weights)
    serve_and_check(built, reference_base(tiny_model_dir, weights), adapters)


def test_a_gptq_base_plus_the_float_adapter(tiny_model_dir, tmp_path, adapters):
    _prequantized("gptq", tiny_model_dir, tmp_path, adapters)


@pytest.mark.extended
def test_an_awq_base_plus_the_float_adapter(tiny_model_dir, tmp_path, adapters):
    _prequantized("awq", tiny_model_dir, tmp_path, adapters)


@pytest.mark.extended
def test_a_bitsandbytes_nf4_base_plus_the_float_adapter(tiny_model_dir, adapters):
    bnb = pytest.importorskip("bitsandbytes")
    config = _config(tiny_model_dir, adapters)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, quantize="bitsandbytes-nf4"))
    built = build_engine(config)
    weights = {
        name.removesuffix(".base"): bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
        for name, module in built.runner.model.named_modules()
        if isinstance(module, bnb.nn.Linear4bit)
    }
    assert len(weights) == 2 * 7 + 1  # every projection and the head
    assert_served_linears_apply(built.runner.model, weights)
    serve_and_check(built, reference_base(tiny_model_dir, weights), adapters)
