"""Tensor parallelism (`--num-shard 2`, gloo on CPU, one thread per shard): the same greedy tokens
as one shard, logprobs within 1e-4, for the paged families (Llama with GQA, Llama with one KV
head repeated on both shards, Qwen2 with q/k/v biases, Gemma2 with its scaled, tied embeddings,
OPT with its own layer names), and for the fallback runner's families (transformers' attention, a
cache per request: GPT-J, BLOOM and MPT with ALiBi, Falcon's three q/k/v layouts, T5's and BART's
encoder-decoders, a quantized one); models it can't cut are refused with the reason."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import signal
import socket

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig
from inference_service.engine import shards
from inference_service.engine.async_engine import STEP_DELAY_ENV
from inference_service.engine.builder import build_engine
from inference_service.errors import ModelLoadError
from inference_service.frontend.front_end import FrontEnd
from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
from inference_service.worker.linears.quant import QuantLinear
from tests.tiny_seq2seq import save_model, seq2seq_config
from tests.tiny_vision_mllama import save_mllama
from tests.unit.tiny_models import tiny_model
from textgen.v1 import generate_pb2 as pb
from tools.checkpoint_writers import write_checkpoint

PROMPTS = ("the quick brown fox", "a", "birds sing café over the hills and far away, again and again")
MAX_NEW_TOKENS = 12
LOGPROB_TOLERANCE = 1e-4
TIMEOUT = 60
SHORT = pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(max_new_tokens=4))
LONG = pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(max_new_tokens=200))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def model_folder(tmp_path_factory, byte_tokenizer, model_type: str, **overrides):
    folder = tmp_path_factory.mktemp(model_type)
    model = tiny_model(model_type, vocab_size=len(byte_tokenizer), **overrides)
    model.save_pretrained(folder)
    byte_tokenizer.save_pretrained(folder)
    return folder


def engine_config(folder, num_shard: int = 1, quantize: str | None = None) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model_id=str(folder),
            device="cpu",
            dtype="float32",
            num_threads=1,
            quantize=quantize,
            num_shard=num_shard,
            master_addr="127.0.0.1",
            master_port=free_port(),
        ),
        cache=CacheConfig(max_batch_total_tokens=1024, block_size=4),
        limits=LimitsConfig(max_total_tokens=256),
    )


def generate(engine, prompts=PROMPTS) -> dict[str, tuple[list[int], list[float], list[float]]]:
    """Each prompt's greedy tokens, their logprobs and its prompt logprobs, the prompts batched together."""
    front_end = FrontEnd(engine.info, engine.tokenizer, engine.grammar_compiler)
    parameters = GenerateParameters(max_new_tokens=MAX_NEW_TOKENS, details=True, decoder_input_details=True)
    outputs: dict[str, list] = {}
    for index, prompt in enumerate(prompts):
        checked = front_end.validator.validate(GenerateRequest(prompt, parameters), stream=False)
        engine.add_request(str(index), checked.engine_request)
        outputs[str(index)] = [[], [], []]
    for _ in range(200):
        for output in engine.step():
            assert output.error is None, output.error
            tokens, logprobs, prompt_logprobs = outputs[output.request_id]
            tokens += [t.id for t in output.tokens]
            logprobs += [t.logprob for t in output.tokens]
            if output.prefill_tokens:
                prompt_logprobs += [t.logprob for t in output.prefill_tokens[1:]]
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    assert engine.stats().num_free_blocks == engine.info.num_blocks
    return {key: (value[0], value[1], value[2]) for key, value in outputs.items()}


def assert_same_generations(sharded: dict, alone: dict) -> None:
    assert sharded.keys() == alone.keys()
    assert sum(len(tokens) for tokens, _, _ in sharded.values()) >= MAX_NEW_TOKENS  # not all at EOS at once
    for key, (tokens, logprobs, prompt_logprobs) in sharded.items():
        alone_tokens, alone_logprobs, alone_prompt = alone[key]
        assert tokens == alone_tokens, f"prompt {key}"
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(alone_logprobs), atol=LOGPROB_TOLERANCE, rtol=0)
        torch.testing.assert_close(
            torch.tensor(prompt_logprobs), torch.tensor(alone_prompt), atol=LOGPROB_TOLERANCE, rtol=0
        )


FAMILIES = {
    "llama": ("llama", {}, None),
    "llama-one-kv-head": ("llama", {"num_key_value_heads": 1}, None),
    "qwen2": ("qwen2", {"attention_bias": True}, None),
    "gemma2": ("gemma2", {}, None),
    "opt": ("opt", {}, None),
    # Quantized projections cut along their groups: per-channel int8 (the group split in two).
    "llama-eetq": ("llama", {}, "eetq"),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_two_shards_generate_what_one_does(family, tmp_path_factory, byte_tokenizer):
    model_type, overrides, quantize = FAMILIES[family]
    folder = model_folder(tmp_path_factory, byte_tokenizer, model_type, **overrides)
    alone_engine = build_engine(engine_config(folder, quantize=quantize))
    assert (alone_engine.info.quantize is not None) == (quantize is not None)
    alone = generate(alone_engine)
    engine = shards.build_engine(engine_config(folder, num_shard=2, quantize=quantize))
    try:
        assert "tensor parallel over 2 shards" in engine.runner.describe()
        if model_type == "llama":  # decode-only steps run through the per-shard decode plan
            assert "fused projections" in engine.runner.describe()
        assert_same_generations(generate(engine), alone)
    finally:
        engine.close()


@pytest.mark.parametrize("variant", ["gptq-4bit-g32", "gptq-act-order"])
def test_a_gptq_checkpoint_is_cut_along_its_groups(variant, tiny_model_dir, tmp_path):
    """4-bit codes in groups of 32: each shard's o/down columns are whole groups. Act-order weights
    (columns permuted) can't be cut by input columns: refused."""
    folder = tmp_path / variant
    act_order = variant == "gptq-act-order"
    write_checkpoint(str(tiny_model_dir), folder, format="gptq", bits=4, group_size=32, desc_act=act_order)
    if act_order:
        with pytest.raises(ModelLoadError, match="act-order"):
            shards.build_engine(engine_config(folder, num_shard=2))
        return
    alone = generate(build_engine(engine_config(folder)))
    engine = shards.build_engine(engine_config(folder, num_shard=2))
    try:
        assert engine.info.quantize == "gptq"
        assert_same_generations(generate(engine), alone)
    finally:
        engine.close()


def test_a_model_it_cannot_cut_is_refused(tmp_path_factory, byte_tokenizer):
    folder = model_folder(tmp_path_factory, byte_tokenizer, "gpt2")
    with pytest.raises(ModelLoadError, match="--num-shard 2: tensor parallelism does not cut 'gpt2' models"):
        shards.build_engine(engine_config(folder, num_shard=2))


# The fallback runner's families: (model type, config overrides, quantize); encoder-decoders by family name.
FALLBACK_FAMILIES = {
    "gptj": ("gptj", {}, None),
    "bloom": ("bloom", {}, None),
    "falcon-multi-query": ("falcon", {}, None),
    "falcon-per-head-qkv": ("falcon", {"multi_query": False}, None),
    "falcon-new-layout-alibi": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2, "alibi": True}, None),
    "falcon-one-kv-group": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 1}, None),
    "mpt": ("mpt", {}, None),
    "gptj-eetq": ("gptj", {}, "eetq"),
}
SEQ2SEQ_FAMILIES = ("t5", "umt5", "bart", "marian")


def fallback_folder(family, tmp_path_factory, byte_tokenizer):
    if family in SEQ2SEQ_FAMILIES:
        config = seq2seq_config(family, byte_tokenizer)
        return save_model(config, byte_tokenizer, tmp_path_factory.mktemp(family)), None
    model_type, overrides, quantize = FALLBACK_FAMILIES[family]
    ids = {name: getattr(byte_tokenizer, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return model_folder(tmp_path_factory, byte_tokenizer, model_type, **ids, **overrides), quantize


@pytest.mark.parametrize("family", [*FALLBACK_FAMILIES, *SEQ2SEQ_FAMILIES])
def test_two_shards_on_the_fallback_runner_generate_what_one_does(family, tmp_path_factory, byte_tokenizer):
    """Each shard runs transformers' attention over its heads with its own per-request caches;
    batched decode rows, released caches and encoder passes stay in step on both shards."""
    folder, quantize = fallback_folder(family, tmp_path_factory, byte_tokenizer)
    alone_engine = build_engine(engine_config(folder, quantize=quantize))
    assert alone_engine.info.attention_impl == "transformers"
    alone = generate(alone_engine)
    engine = shards.build_engine(engine_config(folder, num_shard=2, quantize=quantize))
    try:
        assert "tensor parallel over 2 shards" in engine.runner.describe()
        assert engine.info.attention_impl == "transformers"
        assert (engine.info.quantize is not None) == (quantize is not None)
        if quantize:  # the shard's projections are quantized slices
            assert any(isinstance(m, QuantLinear) for m in engine.runner.runner.model.modules())
        assert_same_generations(generate(engine), alone)
        assert_same_generations(generate(engine), alone)  # again, over the caches the first run released
        assert engine.runner.runner.num_caches == 0
    finally:
        engine.close()


def test_a_fallback_model_it_cannot_cut_is_refused(tmp_path_factory, byte_tokenizer):
    folder = model_folder(tmp_path_factory, byte_tokenizer, "bloom", n_head=3, hidden_size=48)
    with pytest.raises(ModelLoadError, match="--num-shard 2: BloomAttention: 3 attention heads can't be split"):
        shards.build_engine(engine_config(folder, num_shard=2))


def test_a_fallback_architecture_without_a_plan_is_refused_by_name(tmp_path_factory):
    """Mllama (cross-attention to images on the fallback runner) has no plan: a typed error naming it."""
    folder = save_mllama(tmp_path_factory.mktemp("mllama"))
    with pytest.raises(ModelLoadError, match="--num-shard 2: tensor parallelism does not cut 'mllama' models"):
        shards.build_engine(engine_config(folder, num_shard=2))


def test_heads_that_do_not_split_are_refused(tmp_path_factory, byte_tokenizer):
    folder = model_folder(tmp_path_factory, byte_tokenizer, "llama")
    config = engine_config(folder, num_shard=3)
    with pytest.raises(ModelLoadError, match="4 attention heads can't be split evenly over 3 shards"):
        shards.build_engine(dataclasses.replace(config))


# -- a shard that dies --------------------------------------------------------------------------
def follower_processes() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("shard-")]


def health_of(server) -> tuple[int, ...]:
    stub = health_pb2_grpc.HealthStub(server.channel)
    names = ("", "textgen.v1.TextGeneration", "liveness")
    return tuple(stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT).status for name in names)


@pytest.fixture(params=["paged", "fallback"])
def served_model_dir(request, tmp_path_factory, byte_tokenizer):
    """The tiny Llama (the paged runner) or a tiny GPT-J (the fallback runner)."""
    if request.param == "paged":
        return request.getfixturevalue("tiny_model_dir")
    return fallback_folder("gptj", tmp_path_factory, byte_tokenizer)[0]


def test_a_killed_shard_ends_requests_with_typed_errors(start_grpc_server, served_model_dir, monkeypatch):
    """Killed mid-stream: the stream ends UNAVAILABLE, health turns NOT_SERVING, the server says it
    failed (serve exits on it), and every later call is refused with the same typed error."""
    monkeypatch.setenv(STEP_DELAY_ENV, "20")  # the stream is still running when the shard dies
    server = start_grpc_server(engine_config(served_model_dir, num_shard=2))
    assert server.stub.Generate(SHORT, timeout=TIMEOUT).generated_text
    [follower] = follower_processes()
    in_flight = server.stub.GenerateStream(LONG, timeout=TIMEOUT)
    next(in_flight)
    os.kill(follower.pid, signal.SIGKILL)

    with pytest.raises(grpc.RpcError) as raised:
        list(in_flight)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(raised.value.trailing_metadata())["x-error-type"] == "unavailable"
    assert "model can no longer run" in raised.value.details()
    server.call(asyncio.wait_for(server.server.failed.wait(), TIMEOUT))
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    assert health_of(server) == (not_serving, not_serving, not_serving)
    for call in (
        lambda: server.stub.Generate(SHORT, timeout=TIMEOUT),
        lambda: list(server.stub.GenerateStream(SHORT, timeout=TIMEOUT)),
        lambda: server.stub.Health(pb.HealthRequest(), timeout=TIMEOUT),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "model can no longer run" in refused.value.details()


def test_a_shard_killed_while_idle_is_seen_without_a_request(start_grpc_server, served_model_dir):
    server = start_grpc_server(engine_config(served_model_dir, num_shard=2))
    [follower] = follower_processes()
    os.kill(follower.pid, signal.SIGKILL)
    server.call(asyncio.wait_for(server.server.failed.wait(), TIMEOUT))
    with pytest.raises(grpc.RpcError) as refused:
        server.stub.Generate(SHORT, timeout=TIMEOUT)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shard-1 exited" in refused.value.details()
