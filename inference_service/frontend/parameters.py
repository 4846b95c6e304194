"""The front end's request shapes before validation: TGI's `parameters` and the prompt with them.

Every API's converter (`tgi`, `openai`) fills a `GenerateRequest`; `validation` turns it into the
engine's `EngineRequest`. None (or the falsy default) in `GenerateParameters` means "not given":
`defaults` says what each API takes then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inference_service.sample.grammar_spec import GrammarSpec

MAX_SEED = 2**64 - 1


@dataclass
class GenerateParameters:
    """TGI's `parameters` (other APIs' requests are written in these terms by their converters)."""

    best_of: int | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: int | None = None  # None: what fits in the context (`defaults.MAX_NEW_TOKENS`)
    return_full_text: bool | None = None
    stop: list[str] = field(default_factory=list)
    truncate: int | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: int | None = None
    top_n_tokens: int | None = None
    # TGI's dict ({"type": ..., "value": ...}) or a GrammarSpec (the OpenAI converter builds its own).
    grammar: dict | GrammarSpec | None = None
    adapter_id: str | None = None  # a loaded LoRA adapter (or the base model's name); None: the base
    # OpenAI's: subtracted once from the logit of every token already seen; added to given ids' logits.
    presence_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Ours: the first generated token, as a token of the vocabulary (transformers' forced_bos_token_id:
    # M2M100's or mBART's target language, e.g. "__fr__"); default: the model's generation config.
    forced_bos_token: str | None = None


@dataclass
class GenerateRequest:
    inputs: str
    parameters: GenerateParameters = field(default_factory=GenerateParameters)
    # False when a chat template already wrote the special tokens into `inputs`.
    add_special_tokens: bool = True
    # OpenAI's routes end the text before a matched stop sequence; TGI's keep it.
    strip_stop: bool = False
    # Images (`images.LoadedImage`), one per image placeholder in `inputs`, in order.
    images: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class TokenSpan:
    """One prompt token with its text and character offsets into the input, as TGI's `/tokenize`."""

    id: int
    text: str
    start: int
    stop: int
