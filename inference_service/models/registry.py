"""Which architectures the paged engine serves, and the load-time probe that proves it.

Our attention reaches a model only through transformers' attention interface. Some models
bypass it (falcon, gptj), ignore it silently (bloom), or need masks we don't build (mpt,
alibi models). The probe runs a packed batch through the loaded model, one sequence continuing a
cached prefix, and requires one attention call per layer and logits equal to a plain forward.
A model that fails (or is known to) is served by the fallback runner (worker/transformers_runner/)
through transformers' own attention, never served wrong. So are encoder-decoders: T5's decoder
attention bypasses the interface, and cross-attention reads a per-request encoder output.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inference_service.errors import ModelLoadError
from inference_service.outputs import ScheduledRequest
from inference_service.worker.attention.kv_cache import PagedKVCache
from inference_service.worker.attention.paged import ATTENTION_NAME
from inference_service.worker.kernels import int8_activations
from inference_service.worker.runner.model_runner import ModelRunner, probe_layer_shapes

# Passed the probe with tiny random configs (tests/unit/test_architectures.py keeps this honest).
TESTED_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "phi3",
    "gpt2",
    "opt",
    "gpt_neox",
    "gpt_bigcode",
    "olmo",
    "stablelm",
)

# Known not to work with the paged attention, with the reason: loaded for the fallback runner.
FALLBACK_ARCHITECTURES = {
    "bloom": "it uses ALiBi through its own attention and ignores transformers' attention interface",
    "falcon": "its attention does not go through transformers' attention interface",
    "gptj": "its attention does not go through transformers' attention interface",
    "mpt": "it needs an ALiBi mask that the paged attention does not build",
}


# Text-to-text encoder-decoders (AutoModelForSeq2SeqLM) tested on tiny random configs
# (tests/integration/test_seq2seq_models.py); speech and vision ones need inputs this API doesn't take.
ENCODER_DECODER_ARCHITECTURES = ("t5", "mt5", "umt5", "bart", "mbart", "m2m_100", "marian", "pegasus")
ENCODER_DECODER_REASON = (
    "an encoder-decoder: its encoder runs once per request, its decoder through "
    "transformers' attention with the cross-attention cache kept per request"
)


# Vision-language models served on the paged path, images merged into the prompt's embeddings
# (tests/integration/test_vision_models.py checks each against transformers' generate); the
# others are refused by name, with the reason.
VISION_ARCHITECTURES = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "paligemma", "gemma3", "idefics3", "smolvlm")
VISION_NOT_YET: dict[str, str] = {}
# Vision-language models whose language model reads the image through cross-attention layers: served
# by the fallback runner (tests/integration/test_vision_mllama.py), with this reason.
CROSS_ATTENTION_VISION = {
    "mllama": "its language model reads the image through cross-attention layers: transformers' attention, "
    "the image's K/V kept in each request's cache",
}


def is_vision_language(config) -> bool:
    """A checkpoint with a vision tower (LLaVA, Qwen2-VL, Idefics3, PaliGemma, Gemma 3, Mllama...)."""
    return getattr(config, "vision_config", None) is not None


def check_architecture(config) -> str | None:
    """Refuse what can't work before spending time loading weights; the reason a known architecture
    needs the fallback runner (None: the paged path, pending the probe)."""
    model_type = getattr(config, "model_type", "unknown")
    if is_vision_language(config):
        if model_type in CROSS_ATTENTION_VISION:
            return CROSS_ATTENTION_VISION[model_type]
        if model_type not in VISION_ARCHITECTURES:
            why = VISION_NOT_YET.get(model_type, "its image inputs are not supported yet")
            raise ModelLoadError(
                f"vision-language architecture '{model_type}' is not supported: {why}; "
                f"of the vision-language models, this engine serves "
                f"{', '.join((*VISION_ARCHITECTURES, *CROSS_ATTENTION_VISION))}"
            )
        return None
    if getattr(config, "is_encoder_decoder", False):
        if model_type not in ENCODER_DECODER_ARCHITECTURES:
            raise ModelLoadError(
                f"architecture '{model_type}' is not supported: of the encoder-decoders, "
                f"this engine serves {', '.join(ENCODER_DECODER_ARCHITECTURES)}"
            )
        return ENCODER_DECODER_REASON
    return FALLBACK_ARCHITECTURES.get(model_type)


def probe_model(model: torch.nn.Module, device: torch.device, step_done: Callable[[], None] = lambda: None) -> None:
    """Check that the paged engine computes exactly what a plain forward does, or raise;
    `step_done` after each of its steps (the progress bar)."""
    model_type = getattr(model.config, "model_type", "unknown")
    try:
        _run_probe(model, device, step_done)
    except ModelLoadError:
        raise
    except Exception as error:  # noqa: BLE001 — any failure means "can't serve this model"
        raise ModelLoadError(
            f"architecture '{model_type}' failed the paged-attention probe: {type(error).__name__}: {error}"
        ) from error


def _run_probe(model: torch.nn.Module, device: torch.device, step_done: Callable[[], None]) -> None:
    model_type = getattr(model.config, "model_type", "unknown")
    shapes = probe_layer_shapes(model, device)
    num_layers = model.config.get_text_config().num_hidden_layers
    if len(shapes) != num_layers:
        raise ModelLoadError(
            f"architecture '{model_type}' is not supported: the paged attention was "
            f"called {len(shapes)} times for {num_layers} layers"
        )
    dtype = next(model.parameters()).dtype
    block_size = 4
    cache = PagedKVCache(shapes, num_blocks=8, block_size=block_size, dtype=dtype, device=device)
    runner = ModelRunner(model, cache, device)
    vocab = model.config.get_text_config().vocab_size
    seq_a = [(7 * i + 3) % vocab for i in range(9)]
    seq_b = [(11 * i + 5) % vocab for i in range(6)]
    table_a, table_b = [5, 2, 7], [1, 6]  # shuffled blocks, as a real pool hands them out
    steps = [
        [ScheduledRequest("a", 0, 5, seq_a[:5], table_a, True)],
        [ScheduledRequest("a", 5, 3, seq_a[5:8], table_a, True), ScheduledRequest("b", 0, 5, seq_b[:5], table_b, True)],
        [
            ScheduledRequest("a", 8, 1, seq_a[8:9], table_a, True),
            ScheduledRequest("b", 5, 1, seq_b[5:6], table_b, True),
        ],
    ]
    prefixes = {"a": seq_a, "b": seq_b}
    for step in steps:
        step_logits = runner.execute(step)
        calls, logits = step_logits.num_attention_calls, step_logits.sample_logits
        if calls != num_layers:
            raise ModelLoadError(
                f"architecture '{model_type}' is not supported: the paged attention was "
                f"called {calls} times for {num_layers} layers"
            )
        for row, item in enumerate(step):
            end = item.num_computed_tokens + item.num_new_tokens
            expected = _plain_last_logits(model, prefixes[item.request_id][:end], device)
            _compare(model_type, logits[row], expected, dtype)
        step_done()


def _plain_last_logits(model: torch.nn.Module, token_ids: list[int], device: torch.device) -> torch.Tensor:
    """The reference: transformers' own eager attention over one sequence."""
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([token_ids], device=device), use_cache=False)
    finally:  # a vision tower keeps transformers' SDPA (loader.load_model)
        vision = is_vision_language(model.config)
        model.set_attn_implementation(
            {"text_config": ATTENTION_NAME, "vision_config": "sdpa"} if vision else ATTENTION_NAME
        )
    return out.logits[0, -1].float()


def _compare(model_type: str, got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    # int8 activations (opt-in) round the decode rows' inputs, not the plain forward's: bf16's margin.
    exact = dtype == torch.float32 and int8_activations.requested() != "int8"
    tolerance = 1e-4 if exact else 5e-2 * max(1.0, expected.abs().max().item())
    diff = (got - expected).abs().max().item()
    if not diff <= tolerance:
        raise ModelLoadError(
            f"architecture '{model_type}' is not supported: paged logits differ from a "
            f"plain forward by {diff:.3g} (tolerance {tolerance:.3g})"
        )
