"""Decode steps over static buffers padded to a captured batch size (worker/runner/cuda_graphs.py's
StaticDecode): on CPU the same buffer code runs eagerly, and greedy tokens and logprobs equal the
ordinary path's for batches that need padding (3 rows at size 4), for the fused decode plan (Llama)
and transformers' layers (OPT). On CUDA the steps are captured and replayed (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig, parse_cuda_graphs
from inference_service.engine.builder import build_engine
from inference_service.frontend.front_end import FrontEnd
from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
from inference_service.worker.attention.kv_cache import LayerShape, PagedKVCache
from inference_service.worker.runner.cuda_graphs import (
    PADDING_BLOCKS,
    StaticDecode,
    blocks_per_sequence,
    static_decode_sizes,
)
from inference_service.worker.runner.model_runner import ModelRunner
from tests.unit.tiny_models import tiny_model

PROMPTS = ("the quick brown fox", "a", "birds sing café over the hills and far away, again and again")
MAX_NEW_TOKENS = 10
LOGPROB_TOLERANCE = 1e-5
SIZES = (1, 2, 4)


def engine_config(folder, device: str = "cpu", cuda_graphs: str = "1,2,4,8,16,32") -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model_id=str(folder), device=device, dtype="float32", num_threads=1, cuda_graphs=cuda_graphs),
        cache=CacheConfig(max_batch_total_tokens=1024, block_size=4),
        limits=LimitsConfig(max_total_tokens=256),
    )


def generate(engine, prompts=PROMPTS) -> dict[str, tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their logprobs, the prompts batched together."""
    front_end = FrontEnd(engine.info, engine.tokenizer, engine.grammar_compiler)
    parameters = GenerateParameters(max_new_tokens=MAX_NEW_TOKENS, details=True)
    outputs: dict[str, tuple[list[int], list[float]]] = {}
    for index, prompt in enumerate(prompts):
        checked = front_end.validator.validate(GenerateRequest(prompt, parameters), stream=False)
        engine.add_request(str(index), checked.engine_request)
        outputs[str(index)] = ([], [])
    for _ in range(200):
        for output in engine.step():
            assert output.error is None, output.error
            outputs[output.request_id][0].extend(t.id for t in output.tokens)
            outputs[output.request_id][1].extend(t.logprob for t in output.tokens)
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    assert engine.stats().num_free_blocks == engine.info.num_blocks  # the padding block is not the pool's
    return outputs


def run_static_decode_eagerly(engine, sizes: tuple[int, ...]) -> StaticDecode:
    """What the builder does on CUDA, on this CPU engine: a cache one padding block larger than the
    pool, and StaticDecode over the runner's ordinary forward, run eagerly (no capture)."""
    runner = engine.runner
    assert isinstance(runner, ModelRunner) and runner.kv_cache is not None
    cache = runner.kv_cache
    shapes = [LayerShape(num_kv_heads=k.shape[1], head_dim=k.shape[2]) for k in cache.keys]
    runner.kv_cache = PagedKVCache(
        shapes,
        cache.num_blocks + PADDING_BLOCKS,
        cache.block_size,
        cache.dtype,
        cache.keys[0].device,
        cache.kv_dtype,
        cache.writer,
    )
    width = blocks_per_sequence(engine.info.max_total_tokens, 0, cache.block_size)
    runner.static_decode = StaticDecode(
        runner.forward_eager, runner.kv_cache, runner.decode_kernel, sizes, width, capture=False
    )
    return runner.static_decode


def assert_same(ours: dict, ordinary: dict) -> None:
    assert ours.keys() == ordinary.keys()
    for key, (tokens, logprobs) in ours.items():
        assert tokens == ordinary[key][0], f"prompt {key}"
        torch.testing.assert_close(
            torch.tensor(logprobs), torch.tensor(ordinary[key][1]), atol=LOGPROB_TOLERANCE, rtol=0
        )


@pytest.fixture(scope="module", params=["llama", "opt"])
def model_dir(request, tmp_path_factory, byte_tokenizer):
    folder = tmp_path_factory.mktemp(request.param)
    tiny_model(request.param, vocab_size=len(byte_tokenizer)).save_pretrained(folder)
    byte_tokenizer.save_pretrained(folder)
    return folder


def test_padded_static_decode_generates_what_the_ordinary_path_does(model_dir):
    ordinary = generate(build_engine(engine_config(model_dir)))
    engine = build_engine(engine_config(model_dir))
    assert engine.runner.static_decode is None  # never on CPU by itself
    static = run_static_decode_eagerly(engine, SIZES)
    ours = generate(engine)
    assert_same(ours, ordinary)
    assert static.steps_by_size[4] > 0  # 3 rows padded to 4
    assert "CUDA graphs at batch sizes (1, 2, 4)" in engine.runner.describe()


def test_a_batch_larger_than_every_size_runs_the_ordinary_path(model_dir):
    prompts = (*PROMPTS, "zebra", "x y z")
    ordinary = generate(build_engine(engine_config(model_dir)), prompts)
    engine = build_engine(engine_config(model_dir))
    static = run_static_decode_eagerly(engine, (1, 2))
    assert_same(generate(engine, prompts), ordinary)
    assert set(static.steps_by_size) <= {1, 2}  # 5 rows: ordinary; fewer once requests end: padded


def test_static_decode_sizes_follow_the_flag_device_and_shards():
    tgi = parse_cuda_graphs("1,2,4,8,16,32")
    assert static_decode_sizes(tgi, "cuda", sharded=False) == tgi
    assert static_decode_sizes(parse_cuda_graphs("0"), "cuda", sharded=False) == ()
    assert static_decode_sizes(tgi, "cpu", sharded=False) == ()
    assert static_decode_sizes(tgi, "cuda", sharded=True) == ()
    with pytest.raises(ValueError, match="at least one batch size"):
        StaticDecode(lambda *args: torch.zeros(0), None, None, (), 4, capture=False)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
def test_captured_decode_graphs_generate_what_eager_steps_do(model_dir):
    eager = generate(build_engine(engine_config(model_dir, "cuda", cuda_graphs="0")))
    engine = build_engine(engine_config(model_dir, "cuda", cuda_graphs="1,2,4"))
    static = engine.runner.static_decode
    assert static is not None and static.capture
    assert_same(generate(engine), eager)
    assert static.steps_by_size[4] > 0
    assert 4 in static._graphs, "batch 4 ran eagerly: its capture failed (see the log)"
