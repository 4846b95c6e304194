"""One request can never hurt another: a hostile or failing request in a batch ends alone (or, when
its parameters are merely extreme, completes), and the requests batched with it produce exactly
the tokens they produce alone, with every KV block free afterwards.

The engine is driven step by step here, so the hostile request is known to share the bystanders'
batches: it joins them mid-generation, as a request arriving while others stream does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import pytest

from inference_service.engine.builder import build_engine
from inference_service.errors import GenerationError, InferenceError
from inference_service.frontend.front_end import FrontEnd
from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
from inference_service.sample.grammar import GrammarSpec, GrammarState
from inference_service.sampling_params import EngineRequest

BYSTANDERS = {
    "greedy": ("the quick brown fox", {"max_new_tokens": 24}),
    "seeded": ("birds sing café", {"max_new_tokens": 24, "do_sample": True, "seed": 7, "temperature": 0.8}),
    "penalized": ("the the the the", {"max_new_tokens": 24, "repetition_penalty": 1.3, "top_k": 20, "seed": 3}),
    "grammar": ("1234", {"max_new_tokens": 24, "grammar": {"type": "regex", "value": "[a-z ]{5,30}"}}),
}
JOIN_AFTER_STEPS = 3  # the hostile request arrives while the bystanders are generating
INTERNALS = ("Error:", "Exception", "torch", "Traceback", "index", ".py", "llguidance")


@pytest.fixture(scope="module")
def engine(tiny_engine_config):
    return build_engine(tiny_engine_config)


@pytest.fixture(scope="module")
def front_end(engine):
    return FrontEnd(engine.info, engine.tokenizer, engine.grammar_compiler)


def request(front_end: FrontEnd, inputs: str, **parameters) -> EngineRequest:
    """The engine's request as TGI's routes validate it."""
    checked = front_end.validator.validate(GenerateRequest(inputs, GenerateParameters(**parameters)), stream=False)
    return checked.engine_request


@dataclasses.dataclass
class Outcome:
    token_ids: list[int]
    finished: bool = False
    error: InferenceError | None = None


def run(engine, first: Mapping[str, EngineRequest], joining: Mapping[str, EngineRequest] = ()) -> dict[str, Outcome]:
    """Step the engine until `first` and `joining` (added after JOIN_AFTER_STEPS steps) have ended;
    each request's tokens and how it ended."""
    outcomes = {request_id: Outcome([]) for request_id in [*first, *joining]}
    for request_id, spec in first.items():
        engine.add_request(request_id, spec)
    steps = 0
    while engine.has_unfinished() or steps < JOIN_AFTER_STEPS:
        if steps == JOIN_AFTER_STEPS:
            for request_id, spec in dict(joining).items():
                engine.add_request(request_id, spec)
        for output in engine.step():
            outcome = outcomes[output.request_id]
            assert not outcome.finished and outcome.error is None, f"{output.request_id} ended twice"
            outcome.token_ids += [t.id for t in output.tokens]
            outcome.error = output.error
            outcome.finished = output.finish_reason is not None
        steps += 1
    assert all(o.finished or o.error is not None for o in outcomes.values()), outcomes
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"
    assert not engine.live and not engine.scheduler.running and not engine.scheduler.waiting
    return outcomes


@pytest.fixture(scope="module")
def bystanders(engine, front_end):
    """The bystanders' requests and their outcomes when they run without the hostile request."""
    specs = {name: request(front_end, inputs, **params) for name, (inputs, params) in BYSTANDERS.items()}
    alone = run(engine, specs)
    assert all(o.error is None and len(o.token_ids) > 3 for o in alone.values()), alone
    return specs, alone


def assert_unaffected(outcomes: dict[str, Outcome], bystanders) -> None:
    specs, alone = bystanders
    for name in specs:
        assert outcomes[name].error is None, (name, outcomes[name].error)
        assert outcomes[name].token_ids == alone[name].token_ids, name


def assert_clean_error(error: InferenceError | None) -> None:
    """A typed error whose message tells the caller what failed and nothing of the server's insides."""
    assert isinstance(error, GenerationError), error
    assert error.message.startswith("Request failed during generation: Server error: ")
    assert not any(word in error.message for word in INTERNALS), error.message


@pytest.mark.parametrize(
    "parameters",
    [
        {"temperature": 1e-45},  # a denormal: every logit / temperature overflows
        {"temperature": 1e-40, "top_p": 0.5},
        {"temperature": 1e-45, "typical_p": 0.9},
        {"do_sample": True, "repetition_penalty": 1e-45},  # x / p overflows for the prompt's tokens
        {"repetition_penalty": 1e-45},  # greedy, processed logits
        {"do_sample": True, "repetition_penalty": 3e38, "frequency_penalty": -2.0, "temperature": 1e-30},
        {"do_sample": True, "top_k": 1, "repetition_penalty": 1e-45, "frequency_penalty": 2.0},
    ],
    ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()),
)
def test_extreme_temperatures_and_penalties_are_safe_by_construction(engine, front_end, bystanders, parameters):
    """Parameters TGI accepts (any positive temperature and repetition penalty) used to overflow the
    logits to NaN; the NaN made an out-of-range token id and failed every request sampled in that step.
    Now the hostile request completes too, and a tiny temperature samples as greedy does."""
    hostile = request(front_end, "Hello", max_new_tokens=8, seed=1, **parameters)
    outcomes = run(engine, bystanders[0], {"hostile": hostile})
    assert_unaffected(outcomes, bystanders)
    assert outcomes["hostile"].error is None and outcomes["hostile"].finished
    vocab_size = engine.info.vocab_size
    assert all(0 <= t < vocab_size for t in outcomes["hostile"].token_ids)
    if set(parameters) <= {"temperature", "top_p", "typical_p"}:
        greedy = run(engine, {"greedy": request(front_end, "Hello", max_new_tokens=8)})["greedy"]
        assert outcomes["hostile"].token_ids == greedy.token_ids


class BrokenMatcher:
    """A grammar matcher whose masks cannot be computed: alone its native call raises, in a batch the
    grammar engine refuses it (not one of its own matchers); everything else is the real matcher's."""

    def __init__(self, matcher):
        self._matcher = matcher

    def unsafe_compute_mask_ptr(self, *args):
        raise RuntimeError("mask computation failed (grammar.rs:42)")

    def __getattr__(self, name):
        return getattr(self._matcher, name)


@dataclasses.dataclass
class BrokenGrammar:
    """A compiled grammar whose sequences' masks fail: the failure is in one row's logits processing."""

    compiled: object

    def new_state(self) -> GrammarState:
        return GrammarState(BrokenMatcher(self.compiled.new_state().matcher))


def test_a_failing_grammar_mask_fails_its_request_alone(engine, front_end, bystanders):
    """The batched mask fill fails for the whole batch; the step samples its rows one by one, so only
    the broken request ends, with a typed error and no internals in its message."""
    compiled = engine.grammar_compiler.compile(GrammarSpec("regex", "[a-z]+"))
    hostile = dataclasses.replace(request(front_end, "Hello", max_new_tokens=8), grammar=BrokenGrammar(compiled))
    outcomes = run(engine, bystanders[0], {"hostile": hostile})
    assert_unaffected(outcomes, bystanders)
    assert_clean_error(outcomes["hostile"].error)
    assert outcomes["hostile"].token_ids == []


def test_a_logit_bias_outside_the_vocabulary_fails_its_request_alone(engine, front_end, bystanders):
    """A request the front end would refuse, given to the engine directly: its row's processing
    raises (an index past the logits), and only that request ends."""
    spec = request(front_end, "Hello", max_new_tokens=8)
    bias = ((engine.info.vocab_size + 7, 5.0),)
    hostile = dataclasses.replace(spec, sampling=dataclasses.replace(spec.sampling, logit_bias=bias))
    outcomes = run(engine, bystanders[0], {"hostile": hostile, "hostile-too": hostile})
    assert_unaffected(outcomes, bystanders)
    assert_clean_error(outcomes["hostile"].error)
    assert_clean_error(outcomes["hostile-too"].error)


def test_a_failed_model_step_fails_its_batch_and_the_engine_goes_on(engine, front_end, bystanders, monkeypatch):
    """The forward pass is one computation for the whole batch: when it raises, the batch's requests
    end with a typed error (no internals), their blocks are freed, and the next requests run as ever."""
    execute = engine.runner.execute
    calls = []

    def fails_once(scheduled):
        calls.append(len(scheduled))
        if len(calls) == JOIN_AFTER_STEPS + 1:  # the first step with the late request in it
            raise RuntimeError("CUDA error: an illegal memory access was encountered (kernel.cu:42)")
        return execute(scheduled)

    monkeypatch.setattr(engine.runner, "execute", fails_once)
    specs, _ = bystanders
    outcomes = run(engine, specs, {"late": request(front_end, "Hello", max_new_tokens=8)})
    for outcome in outcomes.values():
        assert_clean_error(outcome.error)
        assert outcome.error.message.endswith("the model step failed")
    monkeypatch.undo()
    assert_unaffected(run(engine, specs), bystanders)
