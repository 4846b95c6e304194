"""The contracts between the engine's parts, and what the engine hands to its callers.

- `SchedulerOutput` (scheduler → runner): ints and lists only; the scheduler never sees a tensor.
- `Runner` (what the engine drives): runs a step's `ScheduledRequest`s and returns `StepLogits`,
  the only tensors that cross a contract; the sampler (`sample/`) turns them into token ids.
- `RequestOutput` (engine → callers): a stream's new tokens, text and finish; `GenerateResult` is a
  whole generation. `StepStats` and `EngineStats` are plain numbers for metrics.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from inference_service.errors import InferenceError, RunnerLost

if TYPE_CHECKING:
    import torch

    from inference_service.sampling_params import ImageInput


class FinishReason(enum.StrEnum):
    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"


@dataclass
class ScheduledRequest:
    """One request's share of a step: tokens [num_computed_tokens, +num_new_tokens)."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    token_ids: list[int]  # the tokens to run: [num_computed_tokens, +num_new_tokens)
    block_ids: list[int]  # the request's whole block table after this step's allocation
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    prompt_logprobs: bool = False  # return logprobs of the prompt tokens in this chunk
    # Speculation: the last `num_draft_tokens` of `token_ids` are guesses past the known tokens,
    # run to be verified (each gets logits); they count as computed only once accepted.
    num_draft_tokens: int = 0
    # Encoder-decoders: the encoder's input, on the request's first chunk (again after a preemption).
    encoder_token_ids: list[int] | None = None
    # Images: (row of this chunk, embedding rows [n, H]) that replace those rows' token embeddings.
    image_rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # Multimodal rotary models (Qwen2-VL) with images: each token's three positions [3, num_new_tokens].
    rope_positions: torch.Tensor | None = None
    # Prompt spans [start, end) whose tokens attend to each other both ways, where this chunk runs some.
    both_way_spans: tuple[tuple[int, int], ...] = ()
    # The LoRA adapter of every row of this request (None: the base model's weights alone).
    adapter_id: str | None = None
    # Cross-attention models (Mllama): the request's images, on its first chunk (again after a
    # preemption); the runner's model encodes them itself.
    images: tuple[ImageInput, ...] = ()

    @property
    def num_known_tokens(self) -> int:
        return self.num_new_tokens - self.num_draft_tokens


@dataclass
class SchedulerOutput:
    """What runs in one step."""

    scheduled: list[ScheduledRequest]
    preempted_ids: list[str] = field(default_factory=list)
    # Requests running their first chunk: just admitted, or readmitted after preemption.
    admitted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class StepLogits:
    """fp32 logits: the rows of each request that samples (in scheduled order: one, or 1 + its
    draft tokens with speculation), and the rows of prompt chunks whose prompt logprobs were asked for."""

    sample_ids: list[str]
    sample_logits: torch.Tensor  # [S, V]: sum(num_sample_rows) rows, each request's consecutive
    prompt_logits: dict[str, torch.Tensor]  # request id → [num_new_tokens, V]
    num_attention_calls: int = 0  # one per layer when the model routes attention through us (the probe)
    num_sample_rows: list[int] | None = None  # per sample id; None: one row each


class Runner(Protocol):
    """Runs the model for one step; the paged runner and the transformers fallback both are one."""

    device: torch.device

    # Set once the runner can never run another step (a tensor-parallel shard is gone); else None.
    @property
    def lost(self) -> RunnerLost | None: ...

    def execute(self, scheduled: list[ScheduledRequest]) -> StepLogits:
        """One forward pass over the step's chunks; the logits of the rows to sample."""
        ...

    def release(self, request_id: str) -> None:
        """The request ended: drop whatever the runner keeps for it."""
        ...

    def describe(self) -> str:
        """How steps run, for the startup log line (decode attention, decode steps)."""
        ...

    def close(self) -> None:
        """The engine stops: release what outlives a step (tensor-parallel shard processes)."""
        ...


@dataclass
class Token:
    """A generated token as callers see it."""

    id: int
    text: str
    logprob: float
    special: bool


@dataclass
class PrefillToken:
    id: int
    text: str
    logprob: float | None  # None for the first prompt token
    # The `top_n_tokens` most likely tokens at this position (none for the first prompt token).
    top_tokens: list[Token] = field(default_factory=list)


@dataclass
class RequestTimings:
    """Monotonic seconds (time.perf_counter) of a request's milestones, for metrics and traces."""

    arrival: float
    queued: float | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache at the first admission
    batch_sizes: list[int] = field(default_factory=list)
    preempted_at: list[float] = field(default_factory=list)


@dataclass
class StepStats:
    """What one engine step ran and where its time went, handed to an observer (metrics) by the
    engine thread; plain numbers, so the engine needs no metrics library."""

    num_requests: int
    num_new_requests: int  # requests running their first chunk (admitted, or recomputed after preemption)
    # Decode: a request computing exactly one token past its prompt; anything else (a prompt chunk,
    # a recomputation after preemption) is prefill.
    num_prefill_requests: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    batch_max_tokens: int  # prompt + max_new_tokens over the running requests (TGI's batch max_tokens)
    num_draft_tokens: int = 0  # speculative guesses verified in this step
    # Per request that speculated: how many of its guesses were accepted (TGI's skipped tokens).
    accepted_draft_tokens: list[int] = field(default_factory=list)
    forward_s: float = 0.0  # the model's forward pass
    sample_s: float = 0.0  # sampling, detokenization and stop checks (TGI's decode time)
    total_s: float = 0.0
    failed: bool = False

    @property
    def method(self) -> str:
        """TGI's `method` label: "prefill" when any prompt chunk ran (a chunked-prefill step that
        also carries decodes, as TGI v3's prefill call does), else "decode"."""
        return "prefill" if self.num_prefill_requests else "decode"


@dataclass
class RequestOutput:
    """New tokens of one request since its last output; the last one has `finished` True."""

    request_id: str
    tokens: list[Token] = field(default_factory=list)
    top_tokens: list[list[Token]] = field(default_factory=list)  # parallel to tokens
    prefill_tokens: list[PrefillToken] | None = None  # first output only, when asked
    finish_reason: FinishReason | None = None
    generated_text: str | None = None  # final output only
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    seed: int | None = None  # final output only; None for greedy requests
    error: InferenceError | None = None  # GenerationError or RequestCancelled
    timings: RequestTimings | None = None  # final output only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(frozen=True)
class EngineInfo:
    """What is only known once the model is loaded."""

    model_id: str
    model_sha: str | None
    architecture: str
    dtype: str
    device: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    num_blocks: int
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_size: int | None
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    quantize: str | None = None  # the weight quantization scheme serving; None: full precision
    weights_nbytes: int = 0  # memory the weights take
    prefix_caching: bool = False  # full KV blocks are reused across requests with the same prefix
    speculate: int = 0  # draft tokens proposed per request and step (0: no speculation)
    attention_impl: str = "paged"  # or "transformers": the fallback runner (worker/transformers_runner/)
    # Encoder-decoders: the prompt feeds the encoder, the decoder starts from this token.
    decoder_start_token_id: int | None = None
    # The model's generation config: the first generated token, and the last one at max_new_tokens.
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | None = None
    # When the model was loaded (Unix seconds): the `created` of OpenAI's model card.
    loaded_at: int = 0
    # Vision-language models: the checkpoint's architecture (`architecture` is its text model's);
    # None for a text-only model, which refuses images.
    vision_architecture: str | None = None
    max_images_per_request: int = 0
    max_image_fetch_size: int = 0  # bytes of one fetched or decoded image
    # The image encoder's memory, kept out of the KV cache's budget: a request's images must fit it.
    encoder_crop_values: int = 0  # pixel values of one crop of the vision tower's input size
    encoder_crop_bytes: int = 0  # estimated activation bytes of encoding one crop
    encoder_memory_bytes: int = 0  # reserved at startup (0: not checked)

    @property
    def is_encoder_decoder(self) -> bool:
        return self.decoder_start_token_id is not None

    @property
    def pipeline_tag(self) -> str | None:
        """The hub's pipeline tag for an encoder-decoder; None otherwise, as TGI reports for a model
        it did not fetch from the hub (TGI's `/` defaults `return_full_text` on it)."""
        return "text2text-generation" if self.is_encoder_decoder else None

    @property
    def max_batch_total_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state (for `Info`, metrics and leak checks in tests)."""

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    num_steps: int
    num_cached_blocks: int = 0  # blocks a prefix hit can reuse (held or evictable)
    num_prefix_queried_tokens: int = 0  # tokens to compute at admissions, with prefix caching on
    num_prefix_hit_tokens: int = 0  # of those, reused from the prefix cache
    num_draft_tokens: int = 0  # speculative guesses verified since start
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def speculation_acceptance_rate(self) -> float:
        """Accepted guesses over verified guesses (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Tokens reused over tokens to compute at admission (0 before any admission)."""
        return self.num_prefix_hit_tokens / self.num_prefix_queried_tokens if self.num_prefix_queried_tokens else 0.0


@dataclass
class GenerateResult:
    """A whole generation (unary Generate), best_of already resolved."""

    generated_text: str  # the prompt is prepended when return_full_text was asked
    finish_reason: FinishReason
    num_generated_tokens: int
    num_prompt_tokens: int
    seed: int | None  # None for greedy requests
    tokens: list[Token]
    top_tokens: list[list[Token]]  # one list per generated token; empty lists when not asked
    prefill_tokens: list[PrefillToken]  # empty unless decoder_input_details
    best_of_sequences: list[GenerateResult] = field(default_factory=list)  # the losers
    timings: RequestTimings | None = None
