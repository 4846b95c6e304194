"""A long prompt never holds back a short request: the engine on a tiny model, counted in engine steps
(no clocks), with the outputs checked token for token against each request run alone."""

from __future__ import annotations

import dataclasses

from inference_service.config import SchedulerConfig
from inference_service.engine.builder import build_engine
from inference_service.sampling_params import EngineRequest, SamplingParams, StoppingParams

BUDGET = 16  # tokens per step: the long prompt takes many steps to prefill
LONG = [(7 * i) % 200 + 3 for i in range(300)]
SHORT = [5, 17, 42, 99, 8]


def _greedy(prompt: list[int], max_new_tokens: int) -> EngineRequest:
    return EngineRequest(list(prompt), SamplingParams(), StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True))


def _engine(tiny_engine_config):
    return build_engine(
        dataclasses.replace(
            tiny_engine_config,
            # no prefix caching: the runs alone and together compute every prompt token alike
            cache=dataclasses.replace(tiny_engine_config.cache, block_size=4, prefix_caching=False),
            scheduler=SchedulerConfig(max_batch_prefill_tokens=BUDGET),
        )
    )


def _run(engine, requests: dict[str, EngineRequest], arrivals: dict[str, int]):
    """Step until all finish; request r is added before step arrivals[r]. Returns each request's
    tokens and the step numbers (1-based) in which each got a token."""
    tokens: dict[str, list[int]] = {r: [] for r in requests}
    token_steps: dict[str, list[int]] = {r: [] for r in requests}
    step = 0
    while step == 0 or engine.has_unfinished() or any(at > step for at in arrivals.values()):
        for request_id, at in arrivals.items():
            if at == step:
                engine.add_request(request_id, requests[request_id])
        step += 1
        for output in engine.step():
            assert output.error is None
            tokens[output.request_id] += [t.id for t in output.tokens]
            if output.tokens:
                token_steps[output.request_id].append(step)
    return tokens, token_steps


def test_a_short_request_gets_its_first_token_in_the_next_step_beside_a_long_prefill(tiny_engine_config):
    engine = _engine(tiny_engine_config)
    requests = {"long": _greedy(LONG, 4), "short": _greedy(SHORT, 6)}
    alone_long, alone_steps = _run(engine, {"long": requests["long"]}, {"long": 0})
    alone_short, _ = _run(engine, {"short": requests["short"]}, {"short": 0})

    tokens, steps = _run(engine, requests, {"long": 0, "short": 3})  # the short one arrives in step 4

    first_long = steps["long"][0]
    assert first_long > 300 // BUDGET  # the long prompt takes many steps
    # The short request's first token comes in the step after its arrival, and one more in every
    # step after that, all while the long prompt is still being prefilled...
    assert steps["short"] == [4, 5, 6, 7, 8, 9]
    assert steps["short"][-1] < first_long
    # ...which costs the long prompt at most the steps it shared with the short one (their prefill
    # pool is small, so the short one's tokens wait for little: engine/step_cost.py), and one more
    # where its chunks' ends fall otherwise.
    assert first_long <= alone_steps["long"][0] + len(steps["short"]) + 1
    assert tokens == {"long": alone_long["long"], "short": alone_short["short"]}
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
