"""Grammar specs from TGI's shapes, the compiler's cache and errors, and masks on a real tokenizer."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time

import pytest
import torch

from inference_service.errors import GenerationError, OverloadedError, ValidationError
from inference_service.sample import ops
from inference_service.sample.grammar import (
    GrammarBudget,
    GrammarCompiler,
    GrammarSpec,
    GrammarTooComplex,
    fill_bitmasks,
    grammar_spec_from_tgi,
    prefetch_masks,
)
from inference_service.sample.heap_usage import heap_in_use

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))


@pytest.mark.parametrize(
    "grammar",
    [
        {"type": "json", "value": SCHEMA},
        {"type": "json", "value": json.dumps(SCHEMA, indent=2)},  # a string holding JSON
        {"type": "json_object", "value": SCHEMA},
        {"type": "json_schema", "value": {"name": "thing", "schema": SCHEMA}},
        {"type": "json_schema", "value": {"schema": SCHEMA}},
    ],
)
def test_tgi_json_shapes_give_one_compact_spec(grammar):
    assert grammar_spec_from_tgi(grammar) == GrammarSpec("json", SCHEMA_TEXT)


def test_tgi_regex_and_schemas_without_properties():
    assert grammar_spec_from_tgi({"type": "regex", "value": "[0-9]+"}) == GrammarSpec("regex", "[0-9]+")
    assert grammar_spec_from_tgi({"type": "json", "value": {"type": "object"}}).value == '{"type":"object"}'


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ({"type": "xml", "value": "<a/>"}, "unknown grammar type 'xml'"),
        ({"value": "x"}, "unknown grammar type None"),
        ("[0-9]", "expected an object"),
        ({"type": "regex", "value": {"a": 1}}, "a regex grammar's value must be a string"),
        ({"type": "json", "value": "{oops"}, "the schema is not JSON"),
        ({"type": "json", "value": [1, 2]}, "a JSON schema must be an object"),
        ({"type": "json_schema", "value": SCHEMA}, "a json_schema grammar's value must be"),
        ({"type": "json_schema", "value": {"name": 3, "schema": SCHEMA}}, "`name` must be a string"),
    ],
)
def test_bad_tgi_shapes(grammar, message):
    with pytest.raises(ValidationError, match=re.escape(message)) as error:
        grammar_spec_from_tgi(grammar)
    assert error.value.detail.startswith("grammar is not valid: ")


def test_schema_keys_keep_their_order():  # the output's properties come in this order
    spec = grammar_spec_from_tgi({"type": "json", "value": {"properties": {"z": {}, "a": {}}}})
    assert spec.value == '{"properties":{"z":{},"a":{}}}'


def test_spec_kinds_are_checked():
    with pytest.raises(ValidationError, match="unknown grammar kind 'xml'"):
        GrammarSpec("xml", "<a/>")


def test_a_spec_compiles_once_and_the_cache_is_bounded(byte_tokenizer):
    compiler = GrammarCompiler(byte_tokenizer, len(byte_tokenizer), [1], max_cache_size=2)
    first = compiler.compile(GrammarSpec("regex", "a+"))
    assert compiler.compile(GrammarSpec("regex", "a+")) is first and compiler.num_compiled == 1
    compiler.compile(GrammarSpec("regex", "b+"))
    compiler.compile(GrammarSpec("regex", "a+"))  # most recently used: "b+" is now the oldest
    compiler.compile(GrammarSpec("regex", "c+"))
    assert compiler.num_compiled == 3
    assert compiler.compile(GrammarSpec("regex", "a+")) is first
    compiler.compile(GrammarSpec("regex", "b+"))  # evicted: compiled again
    assert compiler.num_compiled == 4


@pytest.mark.skipif(heap_in_use() is None, reason="the C library does not report its heap (not glibc)")
def test_the_cache_is_bounded_in_bytes_too(byte_tokenizer):
    # `a{20000}` is 8 bytes of spec and megabytes of lexer: a count bound alone let 256 of them in.
    compiler = GrammarCompiler(byte_tokenizer, len(byte_tokenizer), [1], max_cache_bytes=2 * 2**20)
    big = compiler.compile(GrammarSpec("regex", "a{20000}"))
    assert compiler.cache_bytes > 2 * 2**20  # the newest entry stays, whatever it holds
    small = compiler.compile(GrammarSpec("regex", "b+"))
    assert compiler.cache_bytes < 2 * 2**20  # the big one went for it
    assert compiler.compile(GrammarSpec("regex", "b+")) is small and compiler.num_compiled == 2
    assert compiler.compile(GrammarSpec("regex", "a{20000}")) is not big and compiler.num_compiled == 3


@pytest.mark.skipif(heap_in_use() is None, reason="the C library does not report its heap (not glibc)")
def test_a_cached_too_complex_verdict_holds_none_of_its_compilation(byte_tokenizer):
    # Its traceback's frames held the matcher: 170 MiB a verdict for this one on the demo tokenizer.
    budget = GrammarBudget(compile_timeout_s=0.5, max_lexer_states=50_000)
    compiler = GrammarCompiler(byte_tokenizer, len(byte_tokenizer), [1], budget=budget)
    spec = GrammarSpec("regex", "((a{100}){100}){100}")
    before = heap_in_use()
    for _ in range(2):  # the second is the cached verdict, raised again
        with pytest.raises(GrammarTooComplex):
            compiler.compile(spec)
    while compiler.num_running:
        time.sleep(0.01)
    assert compiler.num_compiled == 1
    assert heap_in_use() - before < 16 * 2**20


def test_concurrent_compiles_of_one_spec_compile_once(byte_tokenizer):
    compiler = GrammarCompiler(byte_tokenizer, len(byte_tokenizer), [1])
    spec = GrammarSpec("json", json.dumps({"type": "array", "items": SCHEMA}))
    results = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(spec))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert compiler.num_compiled == 1 and len({id(r) for r in results}) == 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec("regex", "[0-9"), "unclosed character class"),
        (GrammarSpec("json", '{"type": "foo"}'), "Invalid type: foo"),
        (GrammarSpec("json", '{"$ref": "#/nowhere"}'), "does not exist"),
        (GrammarSpec("lark", "start: undefined_rule"), "unknown name"),
    ],
)
def test_invalid_grammars_carry_the_engines_message(byte_grammar_compiler, spec, message):
    with pytest.raises(ValidationError, match=message) as error:
        byte_grammar_compiler.compile(spec)
    assert error.value.detail.startswith("grammar is not valid: ")
    with pytest.raises(ValidationError):  # an invalid spec is not cached as a grammar
        byte_grammar_compiler.compile(spec)


def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> set[int]:
    logits = ops.apply_token_bitmask(torch.zeros(1, vocab_size), bitmask_row[None])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def test_masks_allow_exactly_the_tokens_that_continue_the_regex(byte_tokenizer, byte_grammar_compiler):
    vocab_size = len(byte_tokenizer)
    state = byte_grammar_compiler.compile(GrammarSpec("regex", "[0-9]{3}-[a-z]{2,4}")).new_state()
    texts = {i: byte_tokenizer.decode([i]) for i in range(vocab_size)}
    assert allowed_ids(fill_bitmasks([state], vocab_size)[0], vocab_size) == {
        i
        for i, t in texts.items()
        if re.fullmatch(r"[0-9]{1,3}|[0-9]{3}-|[0-9]{3}-[a-z]{1,4}", t) and i not in byte_tokenizer.all_special_ids
    }
    for token_id in byte_tokenizer.encode("123-ab", add_special_tokens=False):
        state.accept(token_id)
    allowed = allowed_ids(fill_bitmasks([state], vocab_size)[0], vocab_size)
    assert byte_tokenizer.eos_token_id in allowed and not state.is_complete  # accepting, may go on
    assert {texts[i] for i in allowed - {byte_tokenizer.eos_token_id}} <= {chr(c) for c in range(97, 123)} | {
        t for t in texts.values() if re.fullmatch("[a-z]{1,2}", t)
    }
    for token_id in byte_tokenizer.encode("cd", add_special_tokens=False):
        state.accept(token_id)
    assert state.is_complete
    assert allowed_ids(fill_bitmasks([state], vocab_size)[0], vocab_size) == {byte_tokenizer.eos_token_id}


def test_a_rejected_token_is_a_generation_error(byte_tokenizer, byte_grammar_compiler):
    state = byte_grammar_compiler.compile(GrammarSpec("regex", "[0-9]+")).new_state()
    with pytest.raises(GenerationError, match="does not match the request's grammar"):
        state.accept(byte_tokenizer.convert_tokens_to_ids("a"))


def test_states_are_independent_and_rows_fill_together(byte_tokenizer, byte_grammar_compiler):
    vocab_size = len(byte_tokenizer)
    compiled = byte_grammar_compiler.compile(GrammarSpec("regex", "(ab|cd)[0-9]"))
    first, second = compiled.new_state(), compiled.new_state()
    first.accept(byte_tokenizer.convert_tokens_to_ids("a"))
    together = fill_bitmasks([first, second, compiled.new_state()], vocab_size)
    assert torch.equal(together[0], fill_bitmasks([first], vocab_size)[0])
    assert torch.equal(together[1], together[2]) and not torch.equal(together[0], together[1])
    assert byte_tokenizer.convert_tokens_to_ids("b") in allowed_ids(together[0], vocab_size)
    assert byte_tokenizer.convert_tokens_to_ids("b") not in allowed_ids(together[1], vocab_size)


def test_prefetched_masks_are_the_masks_of_the_current_position(byte_tokenizer, byte_grammar_compiler):
    vocab_size = len(byte_tokenizer)
    compiled = byte_grammar_compiler.compile(GrammarSpec("regex", "(ab|cd)[0-9]"))
    states = [compiled.new_state() for _ in range(3)]
    states[0].accept(byte_tokenizer.convert_tokens_to_ids("a"))
    expected = fill_bitmasks(states, vocab_size)
    prefetch_masks(states[:2], vocab_size)  # the third is filled on the spot
    assert torch.equal(fill_bitmasks(states, vocab_size), expected)
    # Prefetched, then advanced without being used: the next mask is the new position's.
    prefetch_masks(states, vocab_size)
    states[1].accept(byte_tokenizer.convert_tokens_to_ids("c"))
    (after_c,) = fill_bitmasks([states[1]], vocab_size)
    assert allowed_ids(after_c, vocab_size) == {byte_tokenizer.convert_tokens_to_ids("d")}
    assert torch.equal(fill_bitmasks([states[0]], vocab_size)[0], expected[0])


def test_logits_wider_than_the_tokenizer_never_allow_the_extra_ids(byte_tokenizer):
    vocab_size = len(byte_tokenizer) + 45  # models often pad their embedding to a multiple of 64
    compiler = GrammarCompiler(byte_tokenizer, vocab_size, [1])
    state = compiler.compile(GrammarSpec("json", '{"type": "object"}')).new_state()
    allowed = allowed_ids(fill_bitmasks([state], vocab_size)[0], vocab_size)
    assert allowed and max(allowed) < len(byte_tokenizer)


def test_lark_grammars_can_mix_free_text_and_a_json_call(byte_tokenizer, byte_grammar_compiler):
    lark = 'start: TEXT | "<|tool|>" call\nTEXT: /[a-z ]+/\ncall: %json{"type": "object"}'
    state = byte_grammar_compiler.compile(GrammarSpec("lark", lark)).new_state()
    for token_id in byte_tokenizer.encode("the fox", add_special_tokens=False):
        state.accept(token_id)
    assert byte_tokenizer.eos_token_id in allowed_ids(
        fill_bitmasks([state], len(byte_tokenizer))[0], len(byte_tokenizer)
    )


def test_apply_token_bitmask_matches_a_per_id_reference():
    generator = torch.Generator().manual_seed(0)
    vocab_size = 77  # not a multiple of 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), generator=generator, dtype=torch.int32)
    logits = torch.randn(3, vocab_size, generator=generator)
    expected = logits.clone()
    for row in range(3):
        for token_id in range(vocab_size):
            if not (int(bitmask[row, token_id // 32]) >> (token_id % 32)) & 1:
                expected[row, token_id] = float("-inf")
    assert torch.equal(ops.apply_token_bitmask(logits, bitmask), expected)
    # The accelerator's unpacking, run here on CPU: the same allowed set.
    assert torch.equal(ops.unpack_bitmask_torch(bitmask, vocab_size), ops.unpack_bitmask_numpy(bitmask, vocab_size))


def test_every_engine_eos_id_ends_a_complete_grammar(byte_tokenizer):
    """The tokenizer's EOS (<|endoftext|>) and a generation-config EOS (<|im_end|>, as SmolLM2-Instruct)."""
    im_end = byte_tokenizer.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(byte_tokenizer, len(byte_tokenizer), [byte_tokenizer.eos_token_id, im_end])
    state = compiler.compile(GrammarSpec("regex", "[0-9]")).new_state()
    assert allowed_ids(fill_bitmasks([state], len(byte_tokenizer))[0], len(byte_tokenizer)).isdisjoint(
        {byte_tokenizer.eos_token_id, im_end}
    )
    state.accept(byte_tokenizer.convert_tokens_to_ids("7"))
    assert state.is_complete
    assert allowed_ids(fill_bitmasks([state], len(byte_tokenizer))[0], len(byte_tokenizer)) == {
        byte_tokenizer.eos_token_id,
        im_end,
    }


# -- budgets: a grammar's cost is paid and checked at compile time, off the engine thread ------------
def chained_schema(depth: int = 62) -> dict:
    """`depth` $defs, each an array of exactly two of the next: tiny to send, 2**depth leaves to write."""
    defs = {
        f"d{i}": {
            "type": "array",
            "prefixItems": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}],
            "minItems": 2,
            "items": False,
        }
        for i in range(depth)
    }
    defs[f"d{depth}"] = {"type": "string"}
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "required": ["x"], "$defs": defs}


@pytest.mark.parametrize(
    ("spec", "first_text"),
    [
        (GrammarSpec("json", json.dumps(chained_schema())), "{"),
        (GrammarSpec("regex", "((a+)+)+b"), "a"),
        (GrammarSpec("regex", "(((a*)*)*)*(b|c)+"), "b"),
    ],
)
def test_deep_schemas_and_nested_quantifiers_compile_cheaply(byte_tokenizer, byte_grammar_compiler, spec, first_text):
    vocab_size = len(byte_tokenizer)
    state = byte_grammar_compiler.compile(spec).new_state()
    allowed = allowed_ids(fill_bitmasks([state], vocab_size)[0], vocab_size)
    assert byte_tokenizer.convert_tokens_to_ids(first_text) in allowed


def test_a_huge_counted_repetition_is_refused_at_compile_and_the_refusal_is_cached(byte_tokenizer):
    compiler = GrammarCompiler(
        byte_tokenizer, len(byte_tokenizer), [1], budget=GrammarBudget(compile_timeout_s=0.2, max_concurrent=1)
    )
    spec = GrammarSpec("regex", "a{1000000}")
    with pytest.raises(GrammarTooComplex, match="grammar is too complex: ") as error:
        compiler.compile(spec)
    assert isinstance(error.value, ValidationError)  # the caller's error: 422 / INVALID_ARGUMENT
    with pytest.raises(GrammarTooComplex):  # sent again: refused without compiling again
        compiler.compile(spec)
    assert compiler.num_compiled == 1


def test_a_regex_that_matches_nothing_is_invalid(byte_grammar_compiler):
    with pytest.raises(ValidationError, match="grammar is not valid: no text matches it"):
        byte_grammar_compiler.compile(GrammarSpec("regex", r"[^\s\S]"))


def test_grammar_error_messages_are_bounded(byte_grammar_compiler):
    with pytest.raises(ValidationError, match="unclosed group") as error:
        byte_grammar_compiler.compile(GrammarSpec("regex", "(x" + "y" * 100_000))
    assert len(error.value.message) < 400 and "\n" not in error.value.message


def test_compiles_queued_past_the_budget_are_overload_not_invalid(byte_tokenizer):
    compiler = GrammarCompiler(
        byte_tokenizer, len(byte_tokenizer), [1], budget=GrammarBudget(compile_timeout_s=0.2, max_concurrent=1)
    )
    slow = threading.Thread(
        target=lambda: pytest.raises(GrammarTooComplex, compiler.compile, GrammarSpec("regex", "((a{100}){100}){100}"))
    )
    slow.start()
    while compiler.num_running == 0:  # the only compiler thread is busy with the slow grammar
        time.sleep(0.005)
    with pytest.raises(OverloadedError):
        compiler.compile(GrammarSpec("regex", "[0-9]+"))
    slow.join()
    while compiler.num_running:  # the slow grammar's compilation runs on to its own end
        time.sleep(0.005)
    assert compiler.compile(GrammarSpec("regex", "[0-9]+")).spec.value == "[0-9]+"  # not cached as refused


@pytest.mark.skipif(sys.platform != "linux", reason="niceness is set per thread on Linux only")
def test_compiler_threads_run_at_the_budgets_niceness_and_leave_the_callers_alone(byte_tokenizer):
    compiler = GrammarCompiler(byte_tokenizer, len(byte_tokenizer), [1], budget=GrammarBudget(niceness=7))
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    compiler.compile(GrammarSpec("regex", "[0-9]+"))
    theirs = compiler._pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    assert (theirs, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())) == (min(19, mine + 7), mine)
    with pytest.raises(ValueError, match="niceness"):
        GrammarBudget(niceness=20)
