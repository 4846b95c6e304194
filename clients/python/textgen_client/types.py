"""The response objects the client returns: plain frozen dataclasses, never protobuf messages.

Names and fields follow the `text-generation` client (`Response`, `Details`, `Token`,
`StreamResponse`, ...), so code written against it reads the same here. A missing value is
`None`, never a protobuf default: the first prompt token has no logprob, a greedy request has no
seed, a non-final stream message has no `generated_text`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class FinishReason(StrEnum):
    """Why generation stopped. A str enum: `details.finish_reason == "length"` works too."""

    LENGTH = "length"
    """`max_new_tokens` (or the server's `max_total_tokens`) was reached."""
    EOS_TOKEN = "eos_token"
    """The model produced its end-of-sequence token."""
    STOP_SEQUENCE = "stop_sequence"
    """One of `stop_sequences` was generated (it stays in `generated_text`, as in TGI)."""


@dataclass(frozen=True)
class Grammar:
    """A guided-generation grammar, as the `text-generation` client takes it.

    Sent as is; the server constrains generation to it (an invalid one is a `ValidationError`).
    """

    type: str
    """`"json"` or `"regex"`."""
    value: str | dict[str, Any]
    """The regex, or the JSON schema (a dict is sent as a JSON object, as TGI takes it)."""


@dataclass(frozen=True)
class Token:
    """A generated token."""

    id: int
    text: str
    logprob: float | None
    """The model's raw log-probability of this token (before penalties, temperature, top-k/p)."""
    special: bool
    """Whether it is a special token (its text is still given, e.g. the final EOS)."""


@dataclass(frozen=True)
class PrefillToken:
    """A prompt token, returned with `decoder_input_details=True`."""

    id: int
    text: str
    logprob: float | None
    """Log-probability of this token given the ones before it; `None` for the first token."""


InputToken = PrefillToken
"""The `text-generation` client's name for `PrefillToken`."""


@dataclass(frozen=True)
class BestOfSequence:
    """One of the other candidates of a `best_of` request (the best one is the response)."""

    generated_text: str
    finish_reason: FinishReason | str
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None
    """For each generated position, its `top_n_tokens` alternatives; `None` when not asked."""


@dataclass(frozen=True)
class Details:
    """Token-level details of a `generate` response (asked with `details=True`, the default)."""

    finish_reason: FinishReason | str
    """A `FinishReason`; a reason this client does not know yet is kept as its string."""
    generated_tokens: int
    seed: int | None
    """The seed the server sampled with; `None` for greedy requests."""
    prefill: list[PrefillToken]
    """The prompt tokens; empty unless `decoder_input_details=True`."""
    tokens: list[Token]
    top_tokens: list[list[Token]] | None
    """For each generated position, its `top_n_tokens` alternatives; `None` when not asked."""
    best_of_sequences: list[BestOfSequence] | None
    """The other candidates of a `best_of` request; `None` otherwise."""


@dataclass(frozen=True)
class Response:
    """The result of `generate`."""

    generated_text: str
    """The generated text (preceded by the prompt when `return_full_text=True`)."""
    details: Details | None
    """`None` only when the request was sent with `details=False`."""


@dataclass(frozen=True)
class StreamDetails:
    """Summary of a finished stream, on its last message."""

    finish_reason: FinishReason | str
    generated_tokens: int
    seed: int | None
    input_length: int
    """Number of prompt tokens (after truncation)."""


@dataclass(frozen=True)
class StreamResponse:
    """One message of `generate_stream`: one generated token."""

    index: int
    """Position of `token` in the generation, 1 for the first one."""
    token: Token
    top_tokens: list[Token] | None
    """The `top_n_tokens` alternatives at this position; `None` when not asked."""
    generated_text: str | None
    """The whole generated text, on the last message only."""
    details: StreamDetails | None
    """On the last message only, when `details=True` (the default)."""


@dataclass(frozen=True)
class SimpleToken:
    """A prompt token as returned by `tokenize`."""

    id: int
    text: str
    start: int
    """Character offset of the token's start in the prompt."""
    stop: int
    """Character offset just past the token's end in the prompt."""


@dataclass(frozen=True)
class EngineStats:
    """The engine's state when `info` was answered: queue, running requests, KV cache blocks."""

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    num_steps: int
    """Engine steps since start; it moves while any request is in flight."""


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded LoRA adapter, as `/info` lists it."""

    id: str
    source: str
    rank: int


@dataclass(frozen=True)
class InfoResponse:
    """The served model and the server's limits (TGI's `/info`), plus live engine stats."""

    model_id: str
    model_sha: str | None
    model_pipeline_tag: str | None
    model_dtype: str
    model_device_type: str
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    validation_workers: int
    max_client_batch_size: int
    router: str
    version: str
    sha: str | None
    docker_label: str | None
    waiting_served_ratio: float
    max_batch_total_tokens: int
    max_waiting_tokens: int
    max_batch_size: int | None
    max_batch_prefill_tokens: int
    block_size: int
    stats: EngineStats | None
    """`None` when the server did not send them."""
    lora_adapters: tuple[LoraAdapter, ...] = ()
    """The LoRA adapters loaded now; requests pick one with `adapter_id`."""
