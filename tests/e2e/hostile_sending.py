"""How tests/e2e/test_hostile.py sends its hostile cases: from threads (the fast subset) or from
worker processes (the soak, so that making and checking thousands of cases does not share this
process's interpreter with the innocent clients), counting the answers and keeping what was wrong;
and the warm-up that fills the server's grammar caches before the soak first samples memory.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from collections import Counter

from inference_service.sample.grammar import DEFAULT_CACHE_BYTES
from tests.e2e.hostile_cases import JSON, problems, send_spec
from tests.e2e.hostile_server import Server
from tests.e2e.soak_attribution import Span

SOAK_CASES = int(os.environ.get("HOSTILE_SOAK_CASES", "3000"))
SOAK_WORKERS = 4
SOAK_PARTS = 8  # RSS is sampled after each part; an idle window of the innocent requests precedes each


def send_all(server: Server, batch, workers: int) -> tuple[Counter, list[str]]:
    """Send the cases `workers` at a time; (count of answers by status, what was wrong)."""
    statuses: Counter = Counter()
    wrong: list[str] = []

    def send(case):
        answer = case.send(server.target)
        return case, answer

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for case, answer in pool.map(send, batch):
            statuses[f"{case.kind} {answer.via} {answer.status}"] += 1
            wrong += [f"{case}: {problem}" for problem in problems(answer)]
    return statuses, wrong


def send_in_processes(server: Server, specs, pool, sent: list[Span] | None = None) -> tuple[Counter, list[str]]:
    """`send_all`, with the cases made and sent by worker processes; each case's span (kind and
    transport, sent, answered) appended to `sent`."""
    statuses: Counter = Counter()
    wrong: list[str] = []
    for name, kind, via, status, found, start, end in pool.map(
        send_spec, specs, [server.target] * len(specs), chunksize=8
    ):
        statuses[f"{kind} {via} {status}"] += 1
        wrong += [f"{name}: {problem}" for problem in found]
        if sent is not None:
            sent.append(Span(f"{kind} {via}", start, end))
    return statuses, wrong


def fill_grammar_caches(server: Server) -> None:
    """Distinct grammars of ~9 MiB of lexer each, past what the API's and the engine core's grammar
    caches hold (sample/grammar.py): from here on a cache only replaces what it evicts, so the soak's
    memory check sees growth beyond the caches' bounds, not the caches filling."""
    import http.client

    count = 2 * DEFAULT_CACHE_BYTES // (9 * 2**20)
    for index in range(count):
        body = {
            "inputs": "a",
            "parameters": {"max_new_tokens": 1, "grammar": {"type": "regex", "value": f"a{{{20000 + index}}}"}},
        }
        connection = http.client.HTTPConnection("127.0.0.1", server.target.gateway_port, timeout=60)
        try:
            connection.request("POST", "/generate", json.dumps(body), JSON)
            assert connection.getresponse().status == 200
        finally:
            connection.close()
