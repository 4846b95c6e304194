"""What a request asks of the engine: its validated parameters and the one neutral request.

The front end (`inference_service.frontend`) turns every API's request into an `EngineRequest`
with every default decided there; the engine never sees protobuf or an API's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. Defaults mean "off"; `do_sample` alone says whether the
    request samples (the front end decides it once, from each API's rules)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    typical_p: float = 1.0  # 1.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off
    frequency_penalty: float = 0.0  # 0.0 = off
    watermark: bool = False
    seed: int = 0  # always set: drawn at random when the caller gave none
    top_n_tokens: int = 0  # alternatives reported per generated token
    prompt_logprobs: bool = False  # TGI's decoder_input_details
    presence_penalty: float = 0.0  # 0.0 = off; OpenAI's: minus once for each token generated so far
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    # (output index, token id): the token the output takes there whatever the logits say (transformers'
    # forced BOS and forced EOS); its logprob is still the model's.
    forced_token_ids: tuple[tuple[int, int], ...] = ()

    @property
    def is_greedy(self) -> bool:
        """Greedy requests take the argmax; their warpers (temperature, top-k...) change nothing."""
        return not self.do_sample

    @property
    def has_penalties(self) -> bool:
        """Penalties over the prompt's and the output's tokens (TGI's two)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0

    @property
    def changes_logits(self) -> bool:
        """Whether anything moves the logits a greedy request takes the argmax of."""
        return self.has_penalties or self.presence_penalty != 0.0 or bool(self.logit_bias) or self.watermark


@dataclass(frozen=True)
class StoppingParams:
    """When a request stops."""

    max_new_tokens: int
    stop_sequences: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: generate exactly max_new_tokens
    strip_stop: bool = False  # end the text before a matched stop sequence (OpenAI's routes); TGI keeps it


class Grammar(Protocol):
    """A compiled grammar (`sample.grammar.CompiledGrammar`): each sequence walks its own state."""

    def new_state(self) -> Any: ...


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt, as the model's processor prepared it (front end) for the vision
    encoder (engine, at admission). Its embedding rows replace the prompt tokens at `positions`."""

    positions: tuple[int, ...]  # prompt indices of its placeholder tokens, one per embedding row
    content_hash: bytes  # of the image's bytes: keys its tokens in the prefix cache
    pixel_values: Any  # the processor's tensor for this image alone
    extras: dict[str, Any] = field(default_factory=dict)  # per-image processor outputs (image_sizes, grid)
    # Prompt tokens [start, end) that attend to each other both ways, this image's among them (Gemma 3:
    # the image's own tokens; PaliGemma: the whole prompt); None: causal, like text.
    span: tuple[int, int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


@dataclass(frozen=True)
class EngineRequest:
    """One generation as the engine runs it: the front end's output, every default decided."""

    prompt_token_ids: list[int]  # after truncation (an encoder-decoder's encoder input)
    sampling: SamplingParams
    stopping: StoppingParams
    grammar: Grammar | None = None  # the output must match it
    text_prefix: str = ""  # put before the final generated_text (TGI's return_full_text: the prompt)
    images: tuple[ImageInput, ...] = ()  # in prompt order
    adapter_id: str | None = None  # the LoRA adapter that serves it; None: the base model

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
