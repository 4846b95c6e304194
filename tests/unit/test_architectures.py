"""The paged attention computes exactly what transformers' eager attention does, per architecture.

For a tiny random model of every architecture the registry accepts, a multi-step packed schedule
(fresh prefills, a chunked-prefill continuation, decodes, decode-only steps) on shuffled block
tables runs through `ModelRunner.execute`, with torch's paths and with the native CPU kernels
(decode attention, few-row linears); every returned logits row must equal a plain per-sequence
forward of a separate eager model with the same weights. Sliding windows and the attention
softcap get negative controls proving the schedule exercises them. The load-time probe must
accept these models and refuse the ones the engine can't serve, naming the architecture.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass

import pytest
import torch
from tiny_models import NUM_LAYERS, VOCAB_SIZE, same_weights_model, tiny_config, tiny_model
from transformers import AutoConfig

from inference_service.errors import ModelLoadError
from inference_service.models import registry
from inference_service.outputs import ScheduledRequest
from inference_service.worker.attention import paged as attention
from inference_service.worker.attention.kv_cache import PagedKVCache
from inference_service.worker.kernels import bindings as cpu_kernels
from inference_service.worker.linears import native as native_linear
from inference_service.worker.runner import decode_step, model_runner
from inference_service.worker.runner.model_runner import ModelRunner, probe_layer_shapes

TOLERANCE = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 24
WINDOW = 5  # shorter than most sequences below, and not a multiple of the block size
SOFTCAP = 1.0
NO_WINDOW = 10_000  # longer than any sequence here: the window has no effect
CONTROL_MIN_DIFF = 1e-2  # a wrong reference must be at least this far off, in every kind of row

# Architectures with a window: their config here makes sequences longer than the window.
SLIDING_OVERRIDES = {
    "mistral": {"sliding_window": WINDOW},
    # Only layers >= max_window_layers slide: layer 0 is full, layer 1 slides.
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "qwen3": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "gemma2": {"sliding_window": WINDOW, "attn_logit_softcapping": SOFTCAP},
    "phi3": {"sliding_window": WINDOW},
}

# Which layers slide: a window on some layers only must be honoured per layer.
EXPECTED_LAYER_TYPES = {
    "qwen2": ["full_attention", "sliding_attention"],
    "qwen3": ["full_attention", "sliding_attention"],
    "gemma2": ["sliding_attention", "full_attention"],
}

NUM_DECODE_ONLY_STEPS = 6


@dataclass(frozen=True)
class Chunk:
    """One request's share of a step: tokens [start, start + count)."""

    request_id: str
    start: int
    count: int
    sample: bool = True
    prompt_logprobs: bool = False

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def kind(self) -> str:
        if self.count == 1:
            return "decode"
        return "prefill" if self.start == 0 else "chunked prefill"


def _schedule() -> list[list[Chunk]]:
    """Step 1: fresh prefills (one of length 1, one prompt's first chunk). Step 2: a chunked-prefill
    continuation, a fresh prefill and decodes interleaved in one packed batch. Then decode-only
    steps, running every sequence past the window."""
    steps = [
        [Chunk("a", 0, 6, sample=False, prompt_logprobs=True), Chunk("c", 0, 1), Chunk("d", 0, 10), Chunk("e", 0, 3)],
        [
            Chunk("c", 1, 1),
            Chunk("a", 6, 5, prompt_logprobs=True),
            Chunk("d", 10, 1),
            Chunk("b", 0, 9),
            Chunk("e", 3, 1),
        ],
    ]
    lengths = {"a": 11, "b": 9, "c": 2, "d": 11, "e": 4}
    for _ in range(NUM_DECODE_ONLY_STEPS):
        steps.append([Chunk(rid, lengths[rid], 1) for rid in ("e", "a", "d", "b", "c")])
        lengths = {rid: n + 1 for rid, n in lengths.items()}
    return steps


SCHEDULE = _schedule()
FINAL_LENGTHS = {c.request_id: c.end for step in SCHEDULE for c in step}  # prompt + generated


def _sequences_and_tables() -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Seeded token ids, and block tables drawn from a shuffled pool (block 0 included, so the
    zero padding of decode block tables points at another sequence's data)."""
    rng = random.Random(1234)
    tokens = {rid: [rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for rid, n in FINAL_LENGTHS.items()}
    pool = list(range(NUM_BLOCKS))
    rng.shuffle(pool)
    tables = {}
    for rid, n in FINAL_LENGTHS.items():
        num_blocks = -(-n // BLOCK_SIZE)
        tables[rid], pool = pool[:num_blocks], pool[num_blocks:]
    assert 0 in {b for table in tables.values() for b in table}
    return tokens, tables


def _scheduled(step: list[Chunk], tokens, tables) -> list[ScheduledRequest]:
    """The step as the scheduler hands it over: each table holds the blocks allocated so far."""
    return [
        ScheduledRequest(
            c.request_id,
            c.start,
            c.count,
            tokens[c.request_id][c.start : c.end],
            tables[c.request_id][: -(-c.end // BLOCK_SIZE)],
            c.sample,
            c.prompt_logprobs,
        )
        for c in step
    ]


@contextlib.contextmanager
def _recording_steps(monkeypatch):
    """Record the metadata of every forward pass, to count attention calls per pass."""
    metas = []
    original = model_runner.step_context

    @contextlib.contextmanager
    def recording(meta):
        metas.append(meta)
        with original(meta) as inner:
            yield inner

    monkeypatch.setattr(model_runner, "step_context", recording)
    yield metas
    monkeypatch.setattr(model_runner, "step_context", original)  # also undone at teardown


class PlainForward:
    """Reference logits: one eager forward per (sequence, prefix length), cached."""

    def __init__(self, model, tokens):
        self.model, self.tokens, self._cache = model, tokens, {}

    def logits(self, request_id: str, end: int) -> torch.Tensor:  # [end, V]
        key = (request_id, end)
        if key not in self._cache:
            ids = torch.tensor([self.tokens[request_id][:end]])
            with torch.inference_mode():
                self._cache[key] = self.model(input_ids=ids, use_cache=False).logits[0].float()
        return self._cache[key]


@dataclass
class Row:
    """One logits row the runner returned: which sequence position it predicts from."""

    step: int
    kind: str
    request_id: str
    position: int  # the row holds logits after token `position`
    logits: torch.Tensor  # [V]


class CountingKernel:
    """The native decode kernel, counting its calls: proves the native parametrization uses it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.calls = 0

    def supports(self, *tensors) -> bool:
        return self.kernel.supports(*tensors)

    def __call__(self, *args):
        self.calls += 1
        return self.kernel(*args)


def _run_paged(
    model, tokens, tables, monkeypatch, decode_kernel=None, decode_step=None, kv_dtype=None, writer=None
) -> list[Row]:
    """Run the schedule through the runner, on a cache pre-filled with garbage (stale blocks)."""
    shapes = probe_layer_shapes(model, torch.device("cpu"))
    assert len(shapes) == NUM_LAYERS
    cache = PagedKVCache(shapes, NUM_BLOCKS, BLOCK_SIZE, torch.float32, torch.device("cpu"), kv_dtype, writer)
    generator = torch.Generator().manual_seed(0)
    for tensor in cache.keys + cache.values:
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    runner = ModelRunner(model, cache, torch.device("cpu"), decode_kernel, decode_step)
    rows = []
    with _recording_steps(monkeypatch) as metas:
        for step_index, step in enumerate(SCHEDULE, start=1):
            out = runner.execute(_scheduled(step, tokens, tables))
            if decode_step is None:  # else every step runs through it: no transformers pass
                assert metas[-1].num_calls == NUM_LAYERS, f"step {step_index}: attention calls != layers"
                assert metas[-1].decode_only == all(c.count == 1 for c in step)
            sampled = [c for c in step if c.sample]
            assert out.sample_ids == [c.request_id for c in sampled]
            assert out.sample_logits.shape == (len(sampled), VOCAB_SIZE)
            for chunk, logits in zip(sampled, out.sample_logits, strict=True):
                rows.append(Row(step_index, chunk.kind, chunk.request_id, chunk.end - 1, logits))
            asked = [c for c in step if c.prompt_logprobs]
            assert sorted(out.prompt_logits) == sorted(c.request_id for c in asked)
            for chunk in asked:
                prompt_logits = out.prompt_logits[chunk.request_id]
                assert prompt_logits.shape == (chunk.count, VOCAB_SIZE)
                rows.extend(
                    Row(step_index, "prompt logprobs", chunk.request_id, chunk.start + i, logits)
                    for i, logits in enumerate(prompt_logits)
                )
    return rows


def _max_diffs(rows: list[Row], reference: PlainForward, key) -> dict:
    diffs: dict = {}
    for row in rows:
        expected = reference.logits(row.request_id, row.position + 1)[row.position]
        diff = (row.logits - expected).abs().max().item()
        diffs[key(row)] = max(diffs.get(key(row), 0.0), diff)
    return diffs


def _config(model_type: str):
    return tiny_config(model_type, **SLIDING_OVERRIDES.get(model_type, {}))


@pytest.fixture(scope="module", autouse=True)
def _registered():
    attention.register()


@pytest.mark.parametrize("decode", ["torch", "native"])
@pytest.mark.parametrize("model_type", registry.TESTED_ARCHITECTURES)
def test_packed_paged_logits_equal_a_plain_forward(model_type, decode, monkeypatch):
    kernel = None
    if decode == "native":
        built = cpu_kernels.load_paged_decode()
        assert built is not None, "the native decode kernel did not build (is a C++ compiler installed?)"
        kernel = CountingKernel(built)
    reference_model = tiny_model(_config(model_type))
    paged_model = same_weights_model(reference_model, attention.ATTENTION_NAME)
    if decode == "native":  # the engine's CPU fp32 setup: few-row projections go native too
        native_linear.install(paged_model, cpu_kernels.load_small_batch_linear())
    assert reference_model.config._attn_implementation == "eager"
    assert paged_model.config._attn_implementation == attention.ATTENTION_NAME
    tokens, tables = _sequences_and_tables()

    rows = _run_paged(paged_model, tokens, tables, monkeypatch, kernel)
    assert len(rows) == sum(c.sample for step in SCHEDULE for c in step) + 11  # + a's prompt rows
    if kernel is not None:
        assert kernel.calls >= NUM_LAYERS * NUM_DECODE_ONLY_STEPS, "the native kernel was not used"
    diffs = _max_diffs(rows, PlainForward(reference_model, tokens), key=lambda row: row.step)
    print(f"{model_type}: max |diff| per step " + " ".join(f"{d:.1e}" for d in diffs.values()))
    bad = {step: diff for step, diff in diffs.items() if not diff <= TOLERANCE}
    assert not bad, f"{model_type}: paged logits differ from a plain forward at steps {bad}"


class CountingStep:
    """A DecodeStep counting the steps it runs."""

    def __init__(self, step):
        assert step is not None, "no decode plan for a Llama-style model"
        self.step, self.calls = step, 0

    def takes(self, *args) -> bool:
        return self.step.takes(*args)

    def forward(self, *args):
        self.calls += 1
        return self.step.forward(*args)


@pytest.mark.parametrize("ops", ["torch", "native"])
@pytest.mark.parametrize("model_type", sorted(set(registry.TESTED_ARCHITECTURES) & decode_step.LLAMA_STYLE))
def test_steps_without_transformers_layers_equal_a_plain_forward(model_type, ops, monkeypatch):
    """Every step through DecodeStep (fused projections; torch or native ops between them): fresh
    prefills, a chunk over a cached prefix beside decodes, then decode-only steps, windows included.
    The logits and prompt logprobs equal a plain forward, and with torch ops they are bitwise those
    of the transformers path over the same weights."""
    reference_model = tiny_model(_config(model_type))
    paged_model = same_weights_model(reference_model, attention.ATTENTION_NAME)
    transformers_path = same_weights_model(reference_model, attention.ATTENTION_NAME)
    kernel = glue = None
    if ops == "native":
        for model in (paged_model, transformers_path):
            native_linear.install(model, cpu_kernels.load_small_batch_linear())
        kernel, glue = cpu_kernels.load_paged_decode(), cpu_kernels.load_decode_glue()
        assert kernel is not None and glue is not None, "the native kernels did not build"
    step = CountingStep(decode_step.decode_step_for(paged_model, glue))
    tokens, tables = _sequences_and_tables()

    rows = _run_paged(paged_model, tokens, tables, monkeypatch, kernel, step)
    assert step.calls == len(SCHEDULE)
    diffs = _max_diffs(rows, PlainForward(reference_model, tokens), key=lambda row: row.step)
    bad = {s: diff for s, diff in diffs.items() if not diff <= TOLERANCE}
    assert not bad, f"{model_type}: DecodeStep's logits differ from a plain forward at steps {bad}"
    expected = _run_paged(transformers_path, tokens, tables, monkeypatch, kernel)
    assert {row.kind for row in rows} == {"prefill", "chunked prefill", "decode", "prompt logprobs"}
    if ops == "torch":
        assert all(torch.equal(row.logits, want.logits) for row, want in zip(rows, expected, strict=True))


# Logits of the tiny Llama against a plain fp32 forward, per KV cache dtype (largest seen: fp16 3.1e-3,
# bf16 2.0e-2, int8 5.6e-2, the same with torch's ops and the native ones; fp32 KV is TOLERANCE above).
KV_DTYPE_TOLERANCE = {torch.float16: 6e-3, torch.bfloat16: 4e-2, torch.int8: 1e-1}


@pytest.mark.parametrize(
    ("kv_dtype", "ops"),
    [(torch.float16, "torch"), (torch.bfloat16, "native"), (torch.int8, "torch"), (torch.int8, "native")],
    ids=str,
)
def test_kv_cache_dtypes_serve_the_plain_forward_within_their_tolerance(kv_dtype, ops, monkeypatch):
    """Prefill, chunked prefill over a cached prefix and decode steps, each reading and writing the
    cache in `kv_dtype`: the logits stay near the fp32 forward, and decode steps through DecodeStep
    (native writes and kernel, or torch's ops) agree with the transformers path."""
    reference_model = tiny_model(_config("llama"))
    paged_model = same_weights_model(reference_model, attention.ATTENTION_NAME)
    transformers_path = same_weights_model(reference_model, attention.ATTENTION_NAME)
    kernel = glue = writer = None
    if ops == "native":
        kernel, glue, writer = (
            cpu_kernels.load_paged_decode(),
            cpu_kernels.load_decode_glue(),
            cpu_kernels.load_kv_writer(),
        )
        assert kernel is not None and glue is not None and writer is not None
        kernel = CountingKernel(kernel)
    step = CountingStep(decode_step.decode_step_for(paged_model, glue))
    tokens, tables = _sequences_and_tables()

    rows = _run_paged(paged_model, tokens, tables, monkeypatch, kernel, step, kv_dtype, writer)
    assert step.calls == len(SCHEDULE)
    if kernel is not None:
        assert kernel.calls >= NUM_LAYERS * NUM_DECODE_ONLY_STEPS, "the native kernel did not read the cache"
    diffs = _max_diffs(rows, PlainForward(reference_model, tokens), key=lambda row: row.step)
    print(f"{kv_dtype} KV, {ops}: max |diff| per step " + " ".join(f"{d:.1e}" for d in diffs.values()))
    bad = {s: diff for s, diff in diffs.items() if not diff <= KV_DTYPE_TOLERANCE[kv_dtype]}
    assert not bad, f"{kv_dtype} KV: logits differ from a plain forward at steps {bad}"
    assert max(diffs.values()) > 0  # the cache really held rounded values
    expected = _run_paged(transformers_path, tokens, tables, monkeypatch, kernel, None, kv_dtype, writer)
    for row, want in zip(rows, expected, strict=True):
        assert (row.logits - want.logits).abs().max().item() <= KV_DTYPE_TOLERANCE[kv_dtype] / 4


def _control_diffs(model_type: str, wrong_overrides: dict, monkeypatch) -> dict[str, float]:
    """Max diff per kind of row between the paged run and a reference with the feature removed."""
    config = _config(model_type)
    reference_model = tiny_model(config)
    paged_model = same_weights_model(reference_model, attention.ATTENTION_NAME)
    wrong_model = tiny_model(tiny_config(model_type, **{**SLIDING_OVERRIDES[model_type], **wrong_overrides}))
    wrong_model.load_state_dict(reference_model.state_dict(), strict=True)
    tokens, tables = _sequences_and_tables()
    rows = _run_paged(paged_model, tokens, tables, monkeypatch)
    right = _max_diffs(rows, PlainForward(reference_model, tokens), key=lambda row: row.kind)
    assert max(right.values()) <= TOLERANCE
    wrong = _max_diffs(
        [row for row in rows if row.position >= WINDOW], PlainForward(wrong_model, tokens), key=lambda row: row.kind
    )
    print(f"{model_type} {wrong_overrides}: control |diff| per kind {wrong}")
    return wrong


@pytest.mark.parametrize("model_type", sorted(SLIDING_OVERRIDES))
def test_the_sliding_window_is_exercised(model_type, monkeypatch):
    """Without the window the reference is far off in prefill, chunked prefill and decode rows,
    so a paged attention that dropped the window would fail the test above."""
    if model_type in EXPECTED_LAYER_TYPES:
        assert _config(model_type).layer_types == EXPECTED_LAYER_TYPES[model_type]
    wrong = _control_diffs(model_type, {"sliding_window": NO_WINDOW}, monkeypatch)
    assert set(wrong) == {"prefill", "chunked prefill", "decode", "prompt logprobs"}
    assert min(wrong.values()) > CONTROL_MIN_DIFF, wrong


def test_the_window_off_by_one_is_caught(monkeypatch):
    """A window one token too wide is caught as well: the boundary itself is tested."""
    wrong = _control_diffs("mistral", {"sliding_window": WINDOW + 1}, monkeypatch)
    assert min(wrong.values()) > CONTROL_MIN_DIFF, wrong


def test_the_gemma2_softcap_is_exercised(monkeypatch):
    """Without the attention softcap the reference is far off in every kind of row."""
    wrong = _control_diffs("gemma2", {"attn_logit_softcapping": None}, monkeypatch)
    assert min(wrong.values()) > CONTROL_MIN_DIFF, wrong


@pytest.mark.parametrize("model_type", registry.TESTED_ARCHITECTURES)
def test_probe_accepts_the_tested_architectures(model_type, monkeypatch):
    config = _config(model_type)
    registry.check_architecture(config)
    model = tiny_model(config, attn_implementation=attention.ATTENTION_NAME)
    with _recording_steps(monkeypatch) as metas:
        registry.probe_model(model, torch.device("cpu"))
    assert len(metas) >= 4  # the shape probe, then three steps
    assert [meta.num_calls for meta in metas] == [NUM_LAYERS] * len(metas)
    # The probe compares against eager on the same model: it must hand it back serving paged.
    assert model.config._attn_implementation == attention.ATTENTION_NAME


def test_a_step_with_no_row_to_keep_still_fills_the_cache(monkeypatch):
    """A prompt chunk that neither samples nor asks for logprobs keeps no logits rows; its K/V
    must still land in the cache for the next chunk."""
    reference_model = tiny_model("llama")
    paged_model = same_weights_model(reference_model, attention.ATTENTION_NAME)
    tokens = list(range(3, 10))
    cache = PagedKVCache(
        probe_layer_shapes(paged_model, torch.device("cpu")), 4, BLOCK_SIZE, torch.float32, torch.device("cpu")
    )
    runner = ModelRunner(paged_model, cache, torch.device("cpu"))
    first = runner.execute([ScheduledRequest("a", 0, 4, tokens[:4], [2], sample=False)])
    assert first.sample_ids == [] and first.sample_logits.shape == (0, VOCAB_SIZE)
    second = runner.execute([ScheduledRequest("a", 4, 3, tokens[4:], [2, 0], sample=True)])
    expected = PlainForward(reference_model, {"a": tokens}).logits("a", len(tokens))[-1]
    assert (second.sample_logits[0] - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("model_type", ["bloom", "mpt"])
def test_probe_refuses_models_that_load_but_compute_wrong(model_type, monkeypatch):
    """bloom accepts the attention name and never calls it; mpt crashes without a mask. Both are
    sent to the fallback runner up front, with the reason, and the probe alone refuses them too."""
    config = tiny_config(model_type)
    assert "ALiBi" in registry.check_architecture(config)
    model = tiny_model(config, attn_implementation=attention.ATTENTION_NAME)
    with _recording_steps(monkeypatch) as metas, pytest.raises(ModelLoadError, match=f"'{model_type}'"):
        registry.probe_model(model, torch.device("cpu"))
    if model_type == "bloom":
        assert metas and all(meta.num_calls == 0 for meta in metas)


def test_probe_refuses_bloom_for_never_calling_the_attention():
    """bloom must be refused by the call count, not only because its logits happen to differ:
    a model that bypasses the interface could match a short probe by luck."""
    model = tiny_model("bloom", attn_implementation=attention.ATTENTION_NAME)
    with pytest.raises(ModelLoadError, match="'bloom'.*called 0 times"):
        registry.probe_model(model, torch.device("cpu"))


@pytest.mark.parametrize("model_type", ["falcon", "gptj"])
def test_architectures_that_bypass_the_interface_go_to_the_fallback_before_loading(model_type):
    """Loading them with our attention name raises inside transformers; the registry must send
    them to the fallback first, saying why, instead of a KeyError."""
    config = tiny_config(model_type)
    assert "attention interface" in registry.check_architecture(config)
    with pytest.raises(KeyError, match=attention.ATTENTION_NAME):
        tiny_model(config, attn_implementation=attention.ATTENTION_NAME)


def test_text_encoder_decoders_go_to_the_fallback_and_others_are_refused_by_name():
    config = tiny_config("t5")
    assert config.is_encoder_decoder
    assert "encoder-decoder" in registry.check_architecture(config)
    speech = AutoConfig.for_model("whisper")  # an encoder-decoder whose input is audio
    with pytest.raises(ModelLoadError, match="'whisper'.*encoder-decoders, this engine serves t5"):
        registry.check_architecture(speech)
