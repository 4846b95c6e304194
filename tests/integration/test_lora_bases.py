"""LoRA adapters over bases other than fp32: quantized (GPTQ, AWQ, bitsandbytes NF4, GGUF Q8_0 and
Q4_1) and bf16. On a quantized base each row of three adapters and the base, mixed in one batch,
equals `peft`'s adapter (in float) over transformers' float model holding the scheme's dequantized
base weights (1e-4 on logprobs, as the fp32 and eetq bases in test_lora_numerics.py); on bf16, peft
over transformers' bf16 model within the tolerances 16 bits need (see BF16_LOGPROB).

The dequantized weights come from outside the serving path: GPTQ and AWQ from the writer's own codes
(so the server's reader and packed kernels are checked too), NF4 from bitsandbytes' own
`dequantize_4bit`, GGUF from the folder transformers' GGUF reader makes of the same file. Each served
base linear is first checked alone against x · Wᵀ in float64.

The reference models are built from a model folder (a config of their own): a reference built on
the served model's config would share it, and transformers' `from_config(attn_implementation=...)`
rewrites the shared config's attention, switching the served model off the paged KV cache.

GPTQ, GGUF Q4_1 and bf16 run in `make test` (10-20 s each on a busy 2-core machine); AWQ, NF4 and
GGUF Q8_0 are the same check on other weights, behind `extended`:
`pytest -m extended tests/integration/test_lora_bases.py`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from benchmarks import peer_models
from inference_service.engine.builder import build_engine
from inference_service.worker.linears.quant import QuantLinear
from inference_service.worker.lora.install import unwrap
from inference_service.worker.weights.gguf.convert import convert_gguf
from tests.benchmarks.test_peer_models import write_tokenizer_gguf
from tests.integration.test_lora_numerics import _REFERENCE, ATTENTION, MLP, _check_against_peft, _config, served_runs
from tests.lora_adapters import make_adapter, peft_model
from tools.checkpoint_writers import write_checkpoint

# bf16 tolerances: measured on these prompts (busy machine, one run), our rows are within 0.105 of
# transformers' logprobs before any divergence, and the divergences are near-ties of at most 0.11 in a
# logit; transformers' own eager and SDPA attention put a logit up to 0.97 apart on the same rows.
BF16_LOGPROB = 0.2
BF16_NEAR_TIE = 0.25

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
    runs = served_runs(built)
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


@pytest.fixture(scope="module")
def tied_tiny_folder(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model's weights, its head tied to the embedding (as llama.cpp's tied files), in the
    sharded layout `peer_models.write_gguf` reads."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("tiny-tied")
    tensors = load_file(tiny_model_dir / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, "model.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize("fmt", [pytest.param("q8_0", marks=pytest.mark.extended), "q4_1"])
def test_a_gguf_base_plus_the_float_adapter(
    fmt, tiny_model_dir, tied_tiny_folder, byte_tokenizer, adapters, tmp_path, monkeypatch
):
    """The packed GGUF (`--quantize gguf`: Q8_0 or Q4_1 projections, the tied head Q8_0) against
    peft over the folder transformers' GGUF reader dequantizes from the same file."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    shape = peer_models.Shape(
        hidden=config["hidden_size"],
        layers=config["num_hidden_layers"],
        heads=config["num_attention_heads"],
        kv_heads=config["num_key_value_heads"],
        intermediate=config["intermediate_size"],
        vocab=config["vocab_size"],
        rope_theta=config.get("rope_theta", config.get("rope_parameters", {}).get("rope_theta", 10000.0)),
        context=config["max_position_embeddings"],
        rms_eps=config["rms_norm_eps"],
    )
    path = tmp_path / f"tiny.{fmt}.gguf"
    tokenizer = write_tokenizer_gguf(tmp_path / "tokenizer.gguf", byte_tokenizer)
    peer_models.write_gguf(shape, "tiny", tied_tiny_folder, path, fmt, tokenizer)
    dequantized = convert_gguf(path, tmp_path / "dequantized")
    base = peft_model(dequantized, None)
    config = _config(path, adapters)
    built = build_engine(dataclasses.replace(config, model=dataclasses.replace(config.model, quantize="gguf")))
    weights = {
        name.removesuffix(".base"): base.get_submodule(name.removesuffix(".base")).weight.detach()
        for name, module in built.runner.model.named_modules()
        if isinstance(module, QuantLinear)
    }
    assert len(weights) == 2 * 7 + 1  # every projection and the head, packed
    assert_served_linears_apply(built.runner.model, weights)
    serve_and_check(built, base, adapters)


def test_a_bf16_base_plus_the_float_adapter(tiny_model_dir, adapters):
    """`--dtype bfloat16` with float adapters against peft over transformers' bf16 model (peft keeps
    the adapters in float32 over a bf16 base, as the server does). Not exact in 16 bits: along our
    tokens (one teacher-forced pass), each token must be transformers' argmax, or at the first
    divergence a near-tie (BF16_NEAR_TIE), and each logprob before it within BF16_LOGPROB."""
    config = _config(tiny_model_dir, adapters)
    built = build_engine(dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bfloat16")))
    assert {p.dtype for p in built.runner.model.parameters()} == {torch.bfloat16}
    runs = served_runs(built)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16, attn_implementation="eager")
    references = {None: base.eval()}
    for name, path in adapters.items():
        references[name] = PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
    compared = 0
    for adapter, prompt_ids, result in runs:
        ours = [t.id for t in result.tokens]
        with torch.inference_mode():
            logits = references[adapter](input_ids=torch.tensor([prompt_ids + ours])).logits[0].float()
        logits = logits[len(prompt_ids) - 1 : -1]
        logprobs = torch.log_softmax(logits, dim=-1)
        for step, token in enumerate(ours):
            best = int(logits[step].argmax())
            if token != best:
                gap = float(logits[step, best] - logits[step, token])
                assert gap <= BF16_NEAR_TIE, (adapter, prompt_ids[:8], step, gap)
                break
            assert result.tokens[step].logprob == pytest.approx(float(logprobs[step, token]), abs=BF16_LOGPROB)
            compared += 1
    assert compared >= len(runs) * 12 // 2  # most of every output is compared, not cut at a divergence
    for adapter in ("alpha", "beta", "gamma"):  # the adapters really change the outputs
        assert {tuple(t.id for t in r.tokens) for a, _, r in runs if a == adapter} != {
            tuple(t.id for t in r.tokens) for a, _, r in runs if a is None
        }, adapter
