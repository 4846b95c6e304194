"""`--rope-scaling` / `--rope-factor`: paired as TGI's launcher pairs them, applied to the config, and
served: the engine's greedy output equals transformers' on the same scaled config."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from inference_service.config import parse_cuda_graphs
from inference_service.engine.builder import build_engine
from inference_service.models.rope import apply_rope_scaling, rope_choice
from tests.conftest import greedy_token_ids


@pytest.mark.parametrize(
    ("scaling", "factor", "expected"),
    [
        (None, None, None),
        ("dynamic", None, ("dynamic", 1.0)),
        (None, 2.0, ("linear", 2.0)),
        ("linear", 4.0, ("linear", 4.0)),
    ],
)
def test_flags_pair_as_tgi_does(scaling, factor, expected):
    assert rope_choice(scaling, factor) == expected


def test_scaling_replaces_the_configs_and_keeps_its_theta(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    theta = config.rope_parameters["rope_theta"]
    apply_rope_scaling(config, None)
    assert config.rope_parameters["rope_type"] == "default"
    apply_rope_scaling(config, ("linear", 2.0))
    assert config.rope_parameters == {"rope_theta": theta, "rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("scaling", ["linear", "dynamic"])
def test_engine_serves_the_scaled_model_as_transformers_computes_it(tiny_engine_config, tiny_model_dir, scaling):
    # Dynamic scaling changes nothing within the stated context: the prompt goes past it.
    prompt = "the quick brown fox " * (60 if scaling == "dynamic" else 4)
    config = dataclasses.replace(
        tiny_engine_config, model=dataclasses.replace(tiny_engine_config.model, rope_scaling=scaling, rope_factor=4.0)
    )
    config = dataclasses.replace(
        config,
        limits=dataclasses.replace(config.limits, max_total_tokens=2048),
        # The prompt in one step, as transformers runs it: dynamic scaling follows each step's longest position.
        scheduler=dataclasses.replace(config.scheduler, max_batch_prefill_tokens=1024),
    )
    engine = build_engine(config)
    assert engine.runner.model.config.rope_parameters["rope_type"] == scaling
    ours = greedy_token_ids(engine, prompt, 8)
    hf_config = AutoConfig.from_pretrained(tiny_model_dir)
    apply_rope_scaling(hf_config, (scaling, 4.0))
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, config=hf_config, dtype=torch.float32).eval()
    unscaled = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([engine.tokenizer(prompt)["input_ids"]])
    with torch.inference_mode():
        expected = reference.generate(ids, do_sample=False, max_new_tokens=8)[0, ids.shape[1] :].tolist()
        scaled_logits, plain_logits = reference(ids).logits, unscaled(ids).logits
    assert ours == expected
    assert (scaled_logits - plain_logits).abs().max().item() > 0.1  # the flag changed the model


def test_cuda_graph_sizes_parse_sorted_and_zero_is_none():
    assert parse_cuda_graphs("8,1,2,2") == (1, 2, 8)
    assert parse_cuda_graphs("0") == ()
    for bad in ("", "0,1", "-1", "a"):
        with pytest.raises(ValueError, match="--cuda-graphs"):
            parse_cuda_graphs(bad)
