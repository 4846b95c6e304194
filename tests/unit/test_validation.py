"""Request validation: TGI's messages, its check order, defaults, truncation, seeds, tokenize."""

from __future__ import annotations

import dataclasses
import random

import pytest

from inference_service.errors import NotFoundError, ValidationError
from inference_service.frontend.adapters import AdapterNames
from inference_service.frontend.parameters import MAX_SEED, GenerateParameters, GenerateRequest
from inference_service.frontend.validation import Validator, tokenize
from inference_service.outputs import EngineInfo
from inference_service.sample.grammar import GrammarSpec

MAX_INPUT = 30
MAX_TOTAL = 40
PROMPT = "the quick brown fox"
FIVE_STOPS = ["a", "b", "c", "d", "e"]


def engine_info(**overrides) -> EngineInfo:
    values = dict(
        model_id="test/model",
        model_sha=None,
        architecture="GPT2LMHeadModel",
        dtype="float32",
        device="cpu",
        vocab_size=331,
        eos_token_ids=(1,),
        block_size=16,
        num_blocks=64,
        max_input_tokens=MAX_INPUT,
        max_total_tokens=MAX_TOTAL,
        max_batch_prefill_tokens=512,
        max_batch_size=None,
        max_concurrent_requests=128,
        max_best_of=2,
        max_stop_sequences=4,
        max_top_n_tokens=5,
    )
    return EngineInfo(**(values | overrides))


@pytest.fixture
def validator(byte_tokenizer, byte_grammar_compiler):
    return Validator(byte_tokenizer, engine_info(), rng=random.Random(7), grammar_compiler=byte_grammar_compiler)


def request(inputs: str = PROMPT, **parameters) -> GenerateRequest:
    return GenerateRequest(inputs=inputs, parameters=GenerateParameters(**parameters))


def error_of(validator: Validator, req: GenerateRequest, *, stream: bool = False) -> str:
    with pytest.raises(ValidationError) as caught:
        validator.validate(req, stream=stream)
    assert caught.value.message == f"Input validation error: {caught.value.detail}"
    return caught.value.detail


def text_with_num_tokens_over(tokenizer, num_tokens: int) -> str:
    """A prompt just over `num_tokens` tokens (BOS included)."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) <= num_tokens:
        words.append(random.Random(len(words)).choice(["fox", "dog", "sing", "home"]))
    return " ".join(words)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (dict(temperature=0.0), "`temperature` must be strictly positive"),
        (dict(temperature=-1.0), "`temperature` must be strictly positive"),
        (dict(temperature=float("nan")), "`temperature` must be strictly positive"),
        (dict(repetition_penalty=0.0), "`repetition_penalty` must be strictly positive"),
        (dict(frequency_penalty=2.01), "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        (dict(frequency_penalty=-2.01), "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        (dict(top_p=1.0), "`top_p` must be > 0.0 and < 1.0"),
        (dict(top_p=0.0), "`top_p` must be > 0.0 and < 1.0"),
        (dict(typical_p=1.0), "`typical_p` must be > 0.0 and < 1.0"),
        (dict(typical_p=0.0), "`typical_p` must be > 0.0 and < 1.0"),
        (dict(top_k=0), "`top_k` must be strictly positive"),
        (dict(top_k=-3), "`top_k` must be strictly positive"),
        (dict(max_new_tokens=0), "`max_new_tokens` must be strictly positive"),
        (dict(stop=FIVE_STOPS), "`stop` supports up to 4 stop sequences. Given: 5"),
        (dict(best_of=2, do_sample=True, seed=1), "`seed` must not be set when `best_of` > 1"),
        (dict(seed=-1), f"`seed` must be >= 0 and <= {MAX_SEED}. Given: -1"),
        (dict(seed=MAX_SEED + 1), f"`seed` must be >= 0 and <= {MAX_SEED}. Given: {MAX_SEED + 1}"),
        (dict(top_n_tokens=6), "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
        (dict(best_of=3, do_sample=True), "`best_of` must be > 0 and <= 2. Given: 3"),
        (dict(best_of=0), "`best_of` must be > 0 and <= 2. Given: 0"),
        (dict(best_of=2), "you must use sampling when `best_of` is > 1"),
        (dict(truncate=0), f"`truncate` must be strictly positive and less than {MAX_INPUT}. Given: 0"),
        (
            dict(truncate=MAX_INPUT + 1),
            f"`truncate` must be strictly positive and less than {MAX_INPUT}. Given: {MAX_INPUT + 1}",
        ),
    ],
)
def test_each_message(validator, parameters, message):
    assert error_of(validator, request(**parameters)) == message


@pytest.mark.parametrize("grammar", [{"type": "json", "value": {"properties": {}}}, GrammarSpec("regex", "[0-9]+")])
def test_grammar_is_refused_when_support_is_disabled(byte_tokenizer, grammar):
    validator = Validator(byte_tokenizer, engine_info(), grammar_compiler=None)  # --disable-grammar-support
    assert error_of(validator, request(grammar=grammar)) == "grammar is not supported"


def test_grammar_compiles_into_the_validated_request(validator):
    validated = validator.validate(request(grammar={"type": "regex", "value": "[0-9]{3}"}), stream=False)
    grammar = validated.engine_request.grammar
    assert grammar is not None and grammar.spec == GrammarSpec("regex", "[0-9]{3}")
    validated = validator.validate(request(grammar=GrammarSpec("json", '{"type": "object"}')), stream=False)
    assert validated.engine_request.grammar.spec.kind == "json"
    assert validator.validate(request(), stream=False).engine_request.grammar is None


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ({"type": "regex", "value": "[0-9"}, "grammar is not valid: "),
        ({"type": "json", "value": {"type": "foo"}}, "grammar is not valid: Invalid type: foo"),
        ({"type": "json", "value": "{not json"}, "grammar is not valid: the schema is not JSON"),
        ({"type": "xml", "value": "<a/>"}, "grammar is not valid: unknown grammar type 'xml'"),
    ],
)
def test_invalid_grammar_messages(validator, grammar, message):
    assert error_of(validator, request(grammar=grammar)).startswith(message)


def test_empty_inputs(validator):
    assert error_of(validator, request("")) == "`inputs` cannot be empty"


def test_length_messages_report_the_real_numbers(validator, byte_tokenizer):
    input_length = len(byte_tokenizer.encode(PROMPT))
    assert error_of(validator, request(max_new_tokens=100)) == (
        f"`inputs` tokens + `max_new_tokens` must be <= {MAX_TOTAL}. "
        f"Given: {input_length} `inputs` tokens and 100 `max_new_tokens`"
    )
    long_prompt = text_with_num_tokens_over(byte_tokenizer, MAX_INPUT)
    long_length = len(byte_tokenizer.encode(long_prompt))
    assert MAX_INPUT < long_length < MAX_TOTAL
    assert error_of(validator, request(long_prompt)) == (
        f"`inputs` must have less than {MAX_INPUT} tokens. Given: {long_length}"
    )


def test_a_prompt_over_the_total_without_max_new_tokens_gets_zero_new_tokens_in_the_message(validator, byte_tokenizer):
    huge_prompt = text_with_num_tokens_over(byte_tokenizer, MAX_TOTAL)
    huge_length = len(byte_tokenizer.encode(huge_prompt))
    assert error_of(validator, request(huge_prompt)) == (
        f"`inputs` tokens + `max_new_tokens` must be <= {MAX_TOTAL}. "
        f"Given: {huge_length} `inputs` tokens and 0 `max_new_tokens`"
    )


def test_stream_only_checks(validator):
    assert error_of(validator, request(best_of=2, do_sample=True), stream=True) == (
        "`best_of` != 1 is not supported when streaming tokens"
    )
    assert error_of(validator, request(decoder_input_details=True), stream=True) == (
        "`decoder_input_details` == true is not supported when streaming tokens"
    )
    assert validator.validate(request(best_of=2, do_sample=True, decoder_input_details=True), stream=False).best_of == 2


def test_stream_only_checks_come_first(validator):
    assert error_of(validator, request("", best_of=5, temperature=0.0), stream=True) == (
        "`best_of` != 1 is not supported when streaming tokens"
    )
    assert error_of(validator, request("", decoder_input_details=True, top_k=0), stream=True) == (
        "`decoder_input_details` == true is not supported when streaming tokens"
    )


def test_best_of_limit_comes_before_the_sampling_rule(validator):
    assert error_of(validator, request(best_of=3, temperature=0.0)) == ("`best_of` must be > 0 and <= 2. Given: 3")
    assert error_of(validator, request(best_of=2, repetition_penalty=0.0)) == (
        "you must use sampling when `best_of` is > 1"
    )


def test_best_of_disabled_when_the_limit_is_one(byte_tokenizer):
    validator = Validator(byte_tokenizer, engine_info(max_best_of=1))
    assert error_of(validator, request(best_of=2, do_sample=True)) == (
        "`best_of` != 1 is not allowed for this endpoint"
    )
    assert validator.validate(request(best_of=1), stream=True).best_of == 1


def test_checks_run_in_tgi_order(validator, byte_tokenizer):
    """Start with every check failing; fixing the first failure reveals the next one."""
    params = dict(
        do_sample=True,
        best_of=2,
        seed=1,
        temperature=0.0,
        repetition_penalty=0.0,
        frequency_penalty=3.0,
        top_p=1.0,
        typical_p=1.0,
        top_k=0,
        max_new_tokens=0,
        stop=FIVE_STOPS,
        top_n_tokens=9,
        truncate=0,
        grammar={"type": "regex", "value": "a+("},
    )
    long_prompt = text_with_num_tokens_over(byte_tokenizer, MAX_INPUT)
    steps = [
        ("temperature", 0.5, "`temperature` must be strictly positive"),
        ("repetition_penalty", 1.2, "`repetition_penalty` must be strictly positive"),
        ("frequency_penalty", 0.5, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        ("top_p", 0.9, "`top_p` must be > 0.0 and < 1.0"),
        ("typical_p", 0.9, "`typical_p` must be > 0.0 and < 1.0"),
        ("top_k", 10, "`top_k` must be strictly positive"),
        ("max_new_tokens", 100, "`max_new_tokens` must be strictly positive"),
        ("stop", ["x"], "`stop` supports up to 4 stop sequences. Given: 5"),
        ("seed", None, "`seed` must not be set when `best_of` > 1"),
        ("top_n_tokens", 2, "`top_n_tokens` must be >= 0 and <= 5. Given: 9"),
        ("inputs", long_prompt, "`inputs` cannot be empty"),
        ("truncate", None, f"`truncate` must be strictly positive and less than {MAX_INPUT}. Given: 0"),
        ("max_new_tokens", 5, "`inputs` tokens + `max_new_tokens` must be <= 40. Given: "),
        ("inputs", PROMPT, f"`inputs` must have less than {MAX_INPUT} tokens. Given: "),
        ("grammar", {"type": "regex", "value": "a+"}, "grammar is not valid: "),
    ]
    inputs = ""
    for field_name, fixed_value, message in steps:
        assert error_of(validator, request(inputs, **params)).startswith(message), field_name
        if field_name == "inputs":
            inputs = fixed_value
        else:
            params[field_name] = fixed_value
    assert validator.validate(request(inputs, **params), stream=False).best_of == 2


def test_defaults(validator, byte_tokenizer):
    validated = validator.validate(request(), stream=True)
    prompt_ids = byte_tokenizer.encode(PROMPT)
    assert validated.engine_request.text_prefix == "" and validated.engine_request.prompt_token_ids == prompt_ids
    assert validated.input_length == len(prompt_ids)
    sampling = validated.engine_request.sampling
    assert (sampling.do_sample, sampling.temperature, sampling.top_k, sampling.top_p, sampling.typical_p) == (
        False,
        1.0,
        0,
        1.0,
        1.0,
    )
    assert (sampling.repetition_penalty, sampling.frequency_penalty, sampling.watermark) == (1.0, 0.0, False)
    assert (sampling.top_n_tokens, sampling.prompt_logprobs) == (0, False)
    assert sampling.is_greedy and 0 <= sampling.seed <= MAX_SEED
    assert validated.engine_request.stopping.max_new_tokens == MAX_TOTAL - len(prompt_ids)  # "auto"
    assert validated.engine_request.stopping.stop_sequences == () and not validated.engine_request.stopping.ignore_eos
    assert (validated.best_of, validated.details, validated.decoder_input_details) == (1, False, False)
    assert validated.engine_request.sampling.top_n_tokens == 0


def test_parameters_are_carried_over(validator):
    validated = validator.validate(
        request(
            temperature=0.7,
            top_k=20,
            top_p=0.9,
            typical_p=0.95,
            repetition_penalty=1.3,
            frequency_penalty=-2.0,
            watermark=True,
            seed=MAX_SEED,
            top_n_tokens=5,
            max_new_tokens=3,
            stop=["a", "b", "c", "d"],
            details=True,
            decoder_input_details=True,
            return_full_text=True,
        ),
        stream=False,
    )
    sampling = validated.engine_request.sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.typical_p) == (0.7, 20, 0.9, 0.95)
    assert (sampling.repetition_penalty, sampling.frequency_penalty) == (1.3, -2.0)
    assert sampling.watermark and sampling.seed == MAX_SEED and sampling.top_n_tokens == 5
    assert sampling.prompt_logprobs and validated.decoder_input_details and validated.details
    assert validated.engine_request.stopping.max_new_tokens == 3
    assert validated.engine_request.stopping.stop_sequences == ("a", "b", "c", "d")
    assert validated.engine_request.text_prefix == PROMPT and sampling.top_n_tokens == 5  # return_full_text


@pytest.mark.parametrize("warper", [dict(temperature=1.0), dict(top_k=5), dict(top_p=0.9), dict(typical_p=0.5)])
def test_giving_any_warper_turns_sampling_on(validator, warper):
    assert validator.validate(request(**warper), stream=False).engine_request.sampling.do_sample


def test_penalties_alone_do_not_turn_sampling_on(validator):
    sampling = validator.validate(request(repetition_penalty=1.5, frequency_penalty=0.5), stream=False)
    assert sampling.engine_request.sampling.is_greedy


def test_a_seed_is_drawn_when_absent(byte_tokenizer):
    validator = Validator(byte_tokenizer, engine_info(), rng=random.Random(3))
    expected = random.Random(3)
    seeds = [validator.validate(request(), stream=False).engine_request.sampling.seed for _ in range(3)]
    assert seeds == [expected.getrandbits(64) for _ in range(3)]
    unseeded = Validator(byte_tokenizer, engine_info())
    drawn = {unseeded.validate(request(), stream=False).engine_request.sampling.seed for _ in range(8)}
    assert len(drawn) == 8 and all(0 <= seed <= MAX_SEED for seed in drawn)
    assert validator.validate(request(seed=42), stream=False).engine_request.sampling.seed == 42


def test_truncate_keeps_the_last_tokens(validator, byte_tokenizer):
    prompt_ids = byte_tokenizer.encode(PROMPT)
    validated = validator.validate(request(truncate=5), stream=False)
    assert validated.engine_request.prompt_token_ids == prompt_ids[-5:] and validated.input_length == 5
    assert validated.engine_request.stopping.max_new_tokens == MAX_TOTAL - 5
    assert validator.validate(request(truncate=MAX_INPUT), stream=False).engine_request.prompt_token_ids == prompt_ids


def test_truncate_lets_a_long_prompt_in(validator, byte_tokenizer):
    long_prompt = text_with_num_tokens_over(byte_tokenizer, MAX_INPUT)
    validated = validator.validate(request(long_prompt, truncate=MAX_INPUT), stream=False)
    assert list(validated.engine_request.prompt_token_ids) == byte_tokenizer.encode(long_prompt)[-MAX_INPUT:]


def test_limits_are_inclusive(validator, byte_tokenizer):
    input_length = len(byte_tokenizer.encode(PROMPT))
    exact = validator.validate(request(max_new_tokens=MAX_TOTAL - input_length), stream=False)
    assert exact.engine_request.stopping.max_new_tokens == MAX_TOTAL - input_length
    wide = Validator(byte_tokenizer, engine_info(max_input_tokens=input_length))
    assert wide.validate(request(), stream=False).engine_request.stopping.max_new_tokens == MAX_TOTAL - input_length


def test_special_tokens_can_be_left_out(validator, byte_tokenizer):
    req = dataclasses.replace(request(), add_special_tokens=False)
    assert list(validator.validate(req, stream=False).engine_request.prompt_token_ids) == byte_tokenizer.encode(
        PROMPT, add_special_tokens=False
    )
    assert byte_tokenizer.encode(PROMPT)[0] == byte_tokenizer.bos_token_id


def test_adapter_id_names_a_loaded_adapter_or_the_base(byte_tokenizer):
    info = engine_info()
    loaded = ["fr", "de"]
    checked = Validator(byte_tokenizer, info, adapters=AdapterNames(info.model_id, lambda: loaded))
    assert checked.validate(request(adapter_id="fr"), stream=False).engine_request.adapter_id == "fr"
    for base in (None, "", info.model_id):
        assert checked.validate(request(adapter_id=base), stream=False).engine_request.adapter_id is None
    with pytest.raises(NotFoundError) as caught:
        checked.validate(request(adapter_id="some/lora"), stream=False)
    assert caught.value.message == (
        "The model or LoRA adapter 'some/lora' does not exist: this server serves the base model "
        f"{info.model_id!r} and the LoRA adapters 'de', 'fr'"
    )


def test_adapter_id_without_adapters_is_not_found(validator):
    with pytest.raises(NotFoundError, match=r"some/lora.*\(no LoRA adapters are loaded\)"):
        validator.validate(request(adapter_id="some/lora"), stream=False)


def test_a_tokenizer_failure_is_a_validation_error():
    class FailingTokenizer:  # stands in for a tokenizer that rejects an input
        def encode(self, text, add_special_tokens=True):
            raise ValueError("cannot encode")

    validator = Validator(FailingTokenizer(), engine_info())
    assert error_of(validator, request()) == "tokenizer error cannot encode"


def test_the_error_type_is_validation(validator):
    with pytest.raises(ValidationError) as caught:
        validator.validate(request(top_k=0), stream=False)
    assert caught.value.error_type == "validation"
    assert str(caught.value) == "Input validation error: `top_k` must be strictly positive"


def test_tokenize_gives_character_offsets(byte_tokenizer):
    inputs = "Привет 日本語 😀 fox"
    spans = tokenize(byte_tokenizer, inputs)
    assert [span.id for span in spans] == byte_tokenizer.encode(inputs)
    bos = spans[0]
    assert (bos.id, bos.text, bos.start, bos.stop) == (byte_tokenizer.bos_token_id, "", 0, 0)
    for span in spans:
        assert span.text == inputs[span.start : span.stop]
    assert spans[-1].stop == len(inputs) and spans[-1].text == "x"
    emoji_start = inputs.index("😀")
    assert any(span.start <= emoji_start < span.stop and "😀" in span.text for span in spans)


def test_tokenize_without_special_tokens_and_truncated(byte_tokenizer):
    spans = tokenize(byte_tokenizer, PROMPT, add_special_tokens=False)
    assert [span.id for span in spans] == byte_tokenizer.encode(PROMPT, add_special_tokens=False)
    assert "".join(span.text for span in spans) == PROMPT
    assert tokenize(byte_tokenizer, PROMPT, truncate=3) == tokenize(byte_tokenizer, PROMPT)[-3:]
