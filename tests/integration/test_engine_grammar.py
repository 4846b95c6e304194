"""Grammar-constrained generation through the engine on the tiny random Llama: outputs match their
grammar, finite grammars end the request by completion, free neighbours are untouched."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig, SchedulerConfig
from inference_service.engine.async_engine import AsyncEngine
from inference_service.errors import GenerationError
from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
from inference_service.outputs import FinishReason
from inference_service.sample.grammar import GrammarSpec
from tests.engine_calls import generate_tgi, validated

PROMPTS = [
    "the quick brown fox",
    "café naïve résumé",
    "1234 3.14 , . ! ?",
    "東京 こんにちは",
    "birds sing café",
    "over a lazy dog",
    "a",
    "Привет мир",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "role": {"enum": ["admin", "user", "guest"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "role", "age", "tags"],
    "additionalProperties": False,
}
REGEX = "[0-9]{3}-[a-z]{2,4}"
JSON_GRAMMAR = {"type": "json", "value": SCHEMA}
REGEX_GRAMMAR = {"type": "regex", "value": REGEX}
MAX_NEW = 120  # far more than either grammar can use


def _config(model_dir, kv_tokens: int = 4096, **scheduler) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model_id=str(model_dir)),
        cache=CacheConfig(block_size=4, max_batch_total_tokens=kv_tokens),
        scheduler=SchedulerConfig(**scheduler),
        limits=LimitsConfig(max_concurrent_requests=64),
    )


@pytest.fixture
def make_engine(tiny_model_dir):
    engines: list[AsyncEngine] = []

    def make(**options) -> AsyncEngine:
        engines.append(AsyncEngine.from_config(_config(tiny_model_dir, **options)))
        engines[-1].start()
        return engines[-1]

    yield make
    for engine in engines:
        asyncio.run(engine.shutdown(timeout_s=1))


async def _run(engine: AsyncEngine, inputs: str, **parameters):
    request = await validated(engine, GenerateRequest(inputs, GenerateParameters(**parameters)), stream=False)
    return await engine.generate(request)


def _assert_json_ok(result) -> None:
    jsonschema.validate(json.loads(result.generated_text), SCHEMA)
    assert result.finish_reason == FinishReason.EOS_TOKEN  # the grammar's completion, well before the limit
    assert result.num_generated_tokens < MAX_NEW


def _assert_regex_ok(result) -> None:
    assert re.fullmatch(REGEX, result.generated_text), result.generated_text
    assert result.finish_reason == FinishReason.EOS_TOKEN or result.num_generated_tokens < MAX_NEW


def _assert_no_leaks(engine: AsyncEngine) -> None:
    stats = engine._engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and not engine._engine.live


async def test_json_schema_and_regex_outputs_match_greedy_and_sampled(make_engine):
    engine = make_engine()
    for prompt in PROMPTS[:3]:
        _assert_json_ok(await _run(engine, prompt, max_new_tokens=MAX_NEW, grammar=JSON_GRAMMAR))
        _assert_regex_ok(await _run(engine, prompt, max_new_tokens=MAX_NEW, grammar=REGEX_GRAMMAR))
        _assert_json_ok(
            await _run(
                engine, prompt, max_new_tokens=MAX_NEW, grammar=JSON_GRAMMAR, do_sample=True, temperature=1.5, seed=7
            )
        )
        _assert_regex_ok(
            await _run(engine, prompt, max_new_tokens=MAX_NEW, grammar=REGEX_GRAMMAR, do_sample=True, top_k=20, seed=8)
        )
    _assert_no_leaks(engine)


async def test_a_finite_regex_ends_by_completion_without_an_eos_token(make_engine):
    engine = make_engine()
    result = await _run(
        engine,
        PROMPTS[0],
        max_new_tokens=MAX_NEW,
        details=True,
        grammar={"type": "regex", "value": "[0-9]{3}-[a-z]{2}"},
    )
    assert result.finish_reason == FinishReason.EOS_TOKEN
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", result.generated_text)
    eos_ids = set(engine.info.eos_token_ids)
    assert not {t.id for t in result.tokens} & eos_ids  # ended by completion: no step spent on EOS


async def test_mixed_batch_leaves_free_requests_unchanged(make_engine):
    engine = make_engine()
    free_alone = [await _run(engine, p, max_new_tokens=30) for p in PROMPTS[3:6]]
    mixed = await asyncio.gather(
        *(_run(engine, p, max_new_tokens=30) for p in PROMPTS[3:6]),
        *(_run(engine, p, max_new_tokens=MAX_NEW, grammar=JSON_GRAMMAR) for p in PROMPTS[:3]),
        *(_run(engine, p, max_new_tokens=MAX_NEW, grammar=REGEX_GRAMMAR) for p in PROMPTS[:2]),
    )
    assert [r.generated_text for r in mixed[:3]] == [r.generated_text for r in free_alone]
    for result in mixed[3:6]:
        _assert_json_ok(result)
    for result in mixed[6:]:
        _assert_regex_ok(result)
    _assert_no_leaks(engine)


async def test_preempted_constrained_requests_resume_in_their_grammar(make_engine):
    roomy = make_engine()
    expected = [await _run(roomy, p, max_new_tokens=MAX_NEW, grammar=JSON_GRAMMAR) for p in PROMPTS]
    tight = make_engine(kv_tokens=200, max_batch_prefill_tokens=64)  # far fewer slots than the load
    results = await asyncio.gather(*(_run(tight, p, max_new_tokens=MAX_NEW, grammar=JSON_GRAMMAR) for p in PROMPTS))
    assert tight.stats().num_preemptions > 0
    assert [r.generated_text for r in results] == [r.generated_text for r in expected]  # greedy: exact
    for result in results:
        _assert_json_ok(result)
    _assert_no_leaks(tight)


async def test_best_of_gives_each_sequence_its_own_grammar_state(make_engine):
    engine = make_engine()
    result = await generate_tgi(
        engine,
        GenerateRequest(
            PROMPTS[0],
            GenerateParameters(
                max_new_tokens=MAX_NEW, grammar=JSON_GRAMMAR, best_of=2, do_sample=True, temperature=1.5, details=True
            ),
        ),
    )
    assert len(result.best_of_sequences) == 1
    _assert_json_ok(result)
    loser = result.best_of_sequences[0]
    jsonschema.validate(json.loads(loser.generated_text), SCHEMA)
    _assert_no_leaks(engine)


async def test_a_spec_from_the_openai_layer_works_like_tgis_dict(make_engine):
    engine = make_engine()
    from_dict = await _run(engine, PROMPTS[1], max_new_tokens=MAX_NEW, grammar=JSON_GRAMMAR)
    from_spec = await _run(engine, PROMPTS[1], max_new_tokens=MAX_NEW, grammar=GrammarSpec("json", json.dumps(SCHEMA)))
    assert from_spec.generated_text == from_dict.generated_text


async def test_a_token_off_the_grammar_fails_only_its_request(make_engine, monkeypatch):
    """Fault injection: the sampler skips the masks (a bug), so the model picks tokens the grammar rejects."""
    from inference_service.sample.sampler import Sampler

    engine = make_engine()
    monkeypatch.setattr(Sampler, "apply_grammars", lambda self, logits, states: logits)
    free = asyncio.create_task(_run(engine, PROMPTS[3], max_new_tokens=20))
    with pytest.raises(GenerationError, match="does not match the request's grammar"):
        await _run(engine, PROMPTS[0], max_new_tokens=MAX_NEW, grammar={"type": "regex", "value": "[0-9]{40}"})
    result = await free
    assert result.num_generated_tokens == 20
    _assert_no_leaks(engine)
