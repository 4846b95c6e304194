"""Validation: a `GenerateRequest` becomes the engine's `EngineRequest`, with TGI's rules,
order and messages; prompt tokenization.

`Validator.validate` applies TGI's parameter rules (its sampling ranges, `do_sample` turned on by any
warper), then `Validator.prepare`, which every API shares: limits, tokenization, seed, grammar.
Other APIs check their own parameter ranges in their converters and call `prepare` with the
sampling decision made explicitly (`openai`: temperature 0 is greedy). Both are synchronous and pure
apart from drawing a seed: tokenizing a long prompt takes a while, so the front end runs them in a
worker thread. Messages are TGI's without the "Input validation error: " prefix, which
`ValidationError` adds.

Deliberate differences from TGI:
- `do_sample` defaults to false also when the whole `parameters` object is absent (TGI then
  samples, a quirk of its v1.4 API).
- Without `max_new_tokens` the request may generate up to `max_total_tokens` in one go; TGI
  schedules such a request in rounds of 1024 tokens, and its length error reports the round
  size. Here messages report the real value.
- `best_of` 0 and a `seed` outside u64 are rejected (TGI's JSON types reject them earlier).
- A prompt that tokenizes to no tokens at all is rejected as empty.
- `adapter_id` names a loaded LoRA adapter or the base model; any other name is refused as not
  found (404), naming the loaded ones (`adapters`).
- A JSON-schema grammar needs no top-level `properties` (TGI requires one): any schema the grammar
  engine compiles is accepted, `{"type": "object"}` (JSON mode) included, and it is not checked
  against the draft 2020-12 meta-schema; an invalid one gets "grammar is not valid: " followed by
  the grammar engine's own message. TGI's "cannot compile regex from schema" never occurs: schemas
  are not turned into regexes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inference_service.errors import ValidationError, quoted, shortened
from inference_service.frontend.adapters import AdapterNames
from inference_service.frontend.image_memory import check_encoder_memory
from inference_service.frontend.parameters import MAX_SEED, GenerateParameters, GenerateRequest, TokenSpan
from inference_service.frontend.vision import VisionPrompts, check_image_count, refuse_images
from inference_service.outputs import EngineInfo
from inference_service.sample.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec, grammar_spec_from_tgi
from inference_service.sampling_params import EngineRequest, ImageInput, SamplingParams, StoppingParams


@dataclass
class ValidatedRequest:
    """What a route runs: the engine's request, and how the route answers it."""

    engine_request: EngineRequest
    best_of: int
    details: bool
    decoder_input_details: bool

    @property
    def input_length(self) -> int:
        return self.engine_request.num_prompt_tokens


def wants_sampling(params: GenerateParameters) -> bool:
    """TGI: sampling is on when asked for, or when any warper is given."""
    return params.do_sample or any(
        value is not None for value in (params.temperature, params.top_k, params.top_p, params.typical_p)
    )


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValidationError(message)


def _positive(value: float) -> bool:
    return value > 0 and math.isfinite(value)


def _open_unit_interval(value: float | None) -> bool:
    return value is None or 0.0 < value < 1.0


class Validator:
    """Checks a request against TGI's rules and the engine's limits, and tokenizes its prompt."""

    def __init__(
        self,
        tokenizer: Any,
        info: EngineInfo,
        *,
        rng: random.Random | None = None,
        grammar_compiler: GrammarCompiler | None = None,
        vision: VisionPrompts | None = None,
        adapters: AdapterNames | None = None,
    ):
        self._tokenizer = tokenizer
        self._vision = vision  # a vision-language model's processor; None: text only
        self._adapters = adapters or AdapterNames(info.model_id)
        self._info = info
        self._rng = rng or random.SystemRandom()
        self._grammar_compiler = grammar_compiler  # None: grammar support disabled
        self._vocab: dict[str, int] | None = None

    def validate(self, request: GenerateRequest, *, stream: bool) -> ValidatedRequest:
        """TGI's routes: raise `ValidationError` with the first failing check, in TGI's order."""
        params = request.parameters
        if stream:
            _check_stream_only(params)
        best_of = self._check_best_of(params.best_of)
        do_sample = wants_sampling(params)
        _check(best_of == 1 or do_sample, "you must use sampling when `best_of` is > 1")
        _check_sampling_ranges(params)
        return self.prepare(request, do_sample=do_sample, best_of=best_of)  # stream rules checked above

    def prepare(
        self, request: GenerateRequest, *, do_sample: bool, best_of: int = 1, stream: bool = False
    ) -> ValidatedRequest:
        """Every API: the engine's limits, the prompt's tokens, the seed and the grammar. The
        sampling ranges were checked by the caller's API, which also decided `do_sample`."""
        params = request.parameters
        if stream:
            _check_stream_only(params)
        adapter_id = self._adapters.resolve(params.adapter_id)
        vocab_size = self._info.vocab_size
        _check(
            all(0 <= token_id < vocab_size for token_id in params.logit_bias),
            f"`logit_bias` keys must be token ids in [0, {vocab_size})",
        )
        _check(params.max_new_tokens is None or params.max_new_tokens > 0, "`max_new_tokens` must be strictly positive")
        self._check_stop(params.stop)
        seed = self._seed(params.seed, best_of)
        top_n_tokens = self._check_top_n_tokens(params.top_n_tokens)
        _check(request.inputs != "", "`inputs` cannot be empty")
        self._check_truncate(params.truncate)
        prompt_token_ids, images = self._tokenize(request, params.truncate)
        max_new_tokens = self._check_lengths(len(prompt_token_ids), params.max_new_tokens)
        forced = self._forced_tokens(params.forced_bos_token, max_new_tokens)
        engine_request = EngineRequest(
            prompt_token_ids=prompt_token_ids,
            sampling=_sampling_params(params, do_sample, seed, top_n_tokens, forced),
            stopping=StoppingParams(
                max_new_tokens=max_new_tokens, stop_sequences=tuple(params.stop), strip_stop=request.strip_stop
            ),
            grammar=self._compile_grammar(params.grammar),
            text_prefix=request.inputs if params.return_full_text else "",
            images=images,
            adapter_id=adapter_id,
        )
        return ValidatedRequest(
            engine_request,
            best_of=best_of,
            details=bool(params.details),
            decoder_input_details=bool(params.decoder_input_details),
        )

    def _compile_grammar(self, grammar: dict | GrammarSpec | None) -> CompiledGrammar | None:
        """Compiled here, on the validation thread: a slow schema never stalls the engine's steps."""
        if grammar is None:
            return None
        compiler = self._grammar_compiler
        if compiler is None:
            raise ValidationError("grammar is not supported")
        spec = grammar if isinstance(grammar, GrammarSpec) else grammar_spec_from_tgi(grammar)
        return compiler.compile(spec)

    def _check_best_of(self, best_of: int | None) -> int:
        best_of = 1 if best_of is None else best_of
        max_best_of = self._info.max_best_of
        _check(max_best_of != 1 or best_of == 1, "`best_of` != 1 is not allowed for this endpoint")
        _check(0 < best_of <= max_best_of, f"`best_of` must be > 0 and <= {max_best_of}. Given: {best_of}")
        return best_of

    def _check_stop(self, stop: Sequence[str]) -> None:
        max_stop = self._info.max_stop_sequences
        _check(len(stop) <= max_stop, f"`stop` supports up to {max_stop} stop sequences. Given: {len(stop)}")

    def _seed(self, seed: int | None, best_of: int) -> int:
        """The caller's seed, or a random u64 drawn here."""
        if seed is None:
            return self._rng.getrandbits(64)
        _check(best_of == 1, "`seed` must not be set when `best_of` > 1")
        _check(0 <= seed <= MAX_SEED, f"`seed` must be >= 0 and <= {MAX_SEED}. Given: {seed}")
        return seed

    def _check_top_n_tokens(self, top_n_tokens: int | None) -> int:
        if top_n_tokens is None:
            return 0
        max_top_n = self._info.max_top_n_tokens
        _check(0 <= top_n_tokens <= max_top_n, f"`top_n_tokens` must be >= 0 and <= {max_top_n}. Given: {top_n_tokens}")
        return top_n_tokens

    def _check_truncate(self, truncate: int | None) -> None:
        max_input = self._info.max_input_tokens
        _check(
            truncate is None or 0 < truncate <= max_input,
            f"`truncate` must be strictly positive and less than {max_input}. Given: {truncate}",
        )

    def _tokenize(self, request: GenerateRequest, truncate: int | None) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt's ids, keeping the last `truncate` (TGI truncates on the left), and its images."""
        if request.images:
            return self._tokenize_with_images(request, truncate)
        try:
            token_ids = list(self._tokenizer.encode(request.inputs, add_special_tokens=request.add_special_tokens))
        except Exception as error:  # any tokenizer failure is the caller's input
            raise ValidationError(f"tokenizer error {shortened(str(error), 200)}") from error
        _check(len(token_ids) > 0, "`inputs` cannot be empty")
        return (token_ids if truncate is None else token_ids[-truncate:]), ()

    def _tokenize_with_images(
        self, request: GenerateRequest, truncate: int | None
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        check_image_count(self._info, len(request.images))
        vision = self._vision
        if vision is None:
            refuse_images(self._info)
        token_ids, images = vision.prepare(request.inputs, request.images, request.add_special_tokens)
        check_encoder_memory(self._info, images)
        _check(
            truncate is None or truncate >= len(token_ids),
            f"`truncate` ({truncate}) would cut the prompt's images: its {len(token_ids)} tokens hold them",
        )
        return token_ids, images

    def _forced_tokens(self, forced_bos_token: str | None, max_new_tokens: int) -> tuple[tuple[int, int], ...]:
        """(output index, token id) pairs the output must hold, as `generate` forces them: the first
        token (the request's `forced_bos_token`, else the model's), then EOS as the last one allowed
        when the model's generation config says so (it wins where both fall on one token)."""
        forced = {}
        bos_id = self._info.forced_bos_token_id
        if forced_bos_token is not None:
            bos_id = self._vocabulary().get(forced_bos_token)
            _check(
                bos_id is not None and bos_id < self._info.vocab_size,
                f"`forced_bos_token` must be a token of the model's vocabulary. Given: {quoted(forced_bos_token)}",
            )
        if bos_id is not None:
            forced[0] = bos_id
        if self._info.forced_eos_token_id is not None and max_new_tokens > 0:
            forced[max_new_tokens - 1] = self._info.forced_eos_token_id
        return tuple(sorted(forced.items()))

    def _vocabulary(self) -> dict[str, int]:
        if self._vocab is None:
            self._vocab = self._tokenizer.get_vocab()  # a copy per call: read once
        return self._vocab

    def _check_lengths(self, input_length: int, max_new_tokens: int | None) -> int:
        """Total then prompt length, as TGI; returns max_new_tokens ("auto" = what fits)."""
        max_total = self._info.max_total_tokens
        if max_new_tokens is None:
            max_new_tokens = max(max_total - input_length, 0)
        _check(
            input_length + max_new_tokens <= max_total,
            f"`inputs` tokens + `max_new_tokens` must be <= {max_total}. "
            f"Given: {input_length} `inputs` tokens and {max_new_tokens} `max_new_tokens`",
        )
        max_input = self._info.max_input_tokens
        _check(input_length <= max_input, f"`inputs` must have less than {max_input} tokens. Given: {input_length}")
        return max_new_tokens


def _check_stream_only(params: GenerateParameters) -> None:
    _check(params.best_of is None or params.best_of == 1, "`best_of` != 1 is not supported when streaming tokens")
    _check(not params.decoder_input_details, "`decoder_input_details` == true is not supported when streaming tokens")


def _check_sampling_ranges(params: GenerateParameters) -> None:
    """temperature, penalties, top_p, typical_p, top_k: TGI's order and messages."""
    _check(params.temperature is None or _positive(params.temperature), "`temperature` must be strictly positive")
    _check(
        params.repetition_penalty is None or _positive(params.repetition_penalty),
        "`repetition_penalty` must be strictly positive",
    )
    _check(
        params.frequency_penalty is None or -2.0 <= params.frequency_penalty <= 2.0,
        "`frequency_penalty` must be >= -2.0 and <= 2.0",
    )
    _check(_open_unit_interval(params.top_p), "`top_p` must be > 0.0 and < 1.0")
    _check(_open_unit_interval(params.typical_p), "`typical_p` must be > 0.0 and < 1.0")
    _check(params.top_k is None or params.top_k > 0, "`top_k` must be strictly positive")
    _check(
        params.presence_penalty is None or -2.0 <= params.presence_penalty <= 2.0,
        "`presence_penalty` must be >= -2.0 and <= 2.0",
    )


def _sampling_params(
    params: GenerateParameters,
    do_sample: bool,
    seed: int,
    top_n_tokens: int,
    forced_token_ids: tuple[tuple[int, int], ...] = (),
) -> SamplingParams:
    """A greedy request keeps temperature 1 (its argmax is the same at any temperature)."""
    return SamplingParams(
        do_sample=do_sample,
        temperature=params.temperature if do_sample and params.temperature is not None else 1.0,
        top_k=params.top_k or 0,
        top_p=1.0 if params.top_p is None else params.top_p,
        typical_p=1.0 if params.typical_p is None else params.typical_p,
        repetition_penalty=1.0 if params.repetition_penalty is None else params.repetition_penalty,
        frequency_penalty=params.frequency_penalty or 0.0,
        watermark=bool(params.watermark),
        seed=seed,
        top_n_tokens=top_n_tokens,
        prompt_logprobs=bool(params.decoder_input_details),
        presence_penalty=params.presence_penalty or 0.0,
        logit_bias=tuple(sorted(params.logit_bias.items())),
        forced_token_ids=forced_token_ids,
    )


def tokenize(
    tokenizer: Any, inputs: str, add_special_tokens: bool = True, *, truncate: int | None = None
) -> list[TokenSpan]:
    """The prompt's tokens with character offsets (the fast tokenizer's offset mapping).

    Special tokens added by the tokenizer have an empty span. Like TGI's `/tokenize`, `truncate`
    keeps the last tokens. A slow tokenizer has no offsets: text "" and offsets 0, as in TGI.
    """
    try:
        encoding = tokenizer(
            inputs, add_special_tokens=add_special_tokens, return_offsets_mapping=True, return_attention_mask=False
        )
        offsets = encoding["offset_mapping"]
    except NotImplementedError:  # slow tokenizers
        encoding = {"input_ids": tokenizer.encode(inputs, add_special_tokens=add_special_tokens)}
        offsets = [(0, 0)] * len(encoding["input_ids"])
    spans = [
        TokenSpan(id=token_id, text=inputs[start:stop], start=start, stop=stop)
        for token_id, (start, stop) in zip(encoding["input_ids"], offsets, strict=True)
    ]
    return spans if truncate is None else spans[-truncate:]
