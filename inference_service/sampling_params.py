"""Validated per-request parameters, as the engine uses them (never protobuf)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. Defaults mean "off"; see `is_greedy`."""

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
    def has_warpers(self) -> bool:
        return (self.temperature != 1.0 or self.top_k != 0 or self.top_p != 1.0
                or self.typical_p != 1.0)

    @property
    def is_greedy(self) -> bool:
        # As TGI: setting any warper turns sampling on even when do_sample is false.
        return not (self.do_sample or self.has_warpers)

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
