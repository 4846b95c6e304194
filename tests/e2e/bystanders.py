"""The innocent requests of tests/e2e/test_hostile.py: a greedy chat stream and a /generate through
Envoy and a gRPC stream to the engine, each looping on its own thread beside the hostile cases, every
output compared with its output alone and every run's start and end kept; and the idle windows, when
they run beside each other only, that give the soak its baseline latency.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable

from tests.e2e.hostile_cases import JSON
from tests.e2e.hostile_server import Server
from textgen.v1 import generate_pb2 as pb

IDLE_WINDOW_S = 2.0  # at least; until each innocent request ran IDLE_RUNS_PER_WINDOW times alone (at most 30 s)
IDLE_RUNS_PER_WINDOW = 10


def chat_stream(server: Server) -> tuple:
    """A greedy chat stream through Envoy: its content, finish reason and that it ended with [DONE]."""
    import http.client

    body = {
        "messages": [{"role": "user", "content": "the quick brown fox"}],
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
    }
    connection = http.client.HTTPConnection("127.0.0.1", server.target.gateway_port, timeout=60)
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body), JSON)
        response = connection.getresponse()
        text = response.read().decode()
    finally:
        connection.close()
    events = text.split("\n\n")[:-1]
    chunks = [json.loads(e[len("data: ") :]) for e in events if e.startswith("data: {")]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]
    return response.status, content, finish, events[-1] if events else None


def tgi_generate(server: Server) -> Timed:
    """A greedy /generate through Envoy: its token ids and text, and the server's own account of its
    time (TGI's timing headers)."""
    import http.client

    body = {"inputs": "birds sing", "parameters": {"max_new_tokens": 30, "details": True}}
    connection = http.client.HTTPConnection("127.0.0.1", server.target.gateway_port, timeout=60)
    try:
        connection.request("POST", "/generate", json.dumps(body), JSON)
        response = connection.getresponse()
        answer = json.loads(response.read())
    finally:
        connection.close()
    output = (response.status, answer.get("generated_text"), [t["id"] for t in answer["details"]["tokens"]])
    times = {name: int(response.getheader(f"x-{name}-time") or -1) / 1000 for name in SERVER_TIMES}
    return Timed(output, times)


@dataclasses.dataclass(frozen=True)
class Timed:
    """An innocent request's output, with the server's account of where its time went (seconds)."""

    output: tuple
    server_s: dict[str, float]


SERVER_TIMES = ("total", "validation", "queue", "inference")


def grpc_stream(server: Server) -> tuple:
    """A greedy GenerateStream to the engine directly: its token ids."""
    request = pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(max_new_tokens=40))
    return tuple(message.token.id for message in server.stub.GenerateStream(request, timeout=60))


BYSTANDERS: dict[str, Callable[[Server], tuple | Timed]] = {
    "chat_stream": chat_stream,
    "tgi_generate": tgi_generate,
    "grpc_stream": grpc_stream,
}


def untimed(output: tuple | Timed) -> tuple:
    return output.output if isinstance(output, Timed) else output


class Bystanders:
    """The innocent requests, each in a loop on its own thread until stopped: every output is
    compared with its output alone, and every run's latency kept."""

    def __init__(self, server: Server, alone: dict[str, tuple]):
        self.server, self.alone = server, alone
        self.latencies: dict[str, list[float]] = {name: [] for name in BYSTANDERS}
        self.runs: dict[str, list[tuple[float, float]]] = {name: [] for name in BYSTANDERS}  # (start, end)
        self.server_s: dict[tuple[str, float], dict[str, float]] = {}  # (name, start) → the server's account
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(name,), daemon=True) for name in BYSTANDERS]

    def __enter__(self) -> Bystanders:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    def _loop(self, name: str) -> None:
        while True:
            started = time.monotonic()
            try:
                output = BYSTANDERS[name](self.server)
            except Exception as error:  # noqa: BLE001 - a bystander's failure is what this records
                self.failures.append(f"{name}: {type(error).__name__}: {str(error)[:300]}")
            else:
                ended = time.monotonic()
                self.latencies[name].append(ended - started)
                self.runs[name].append((started, ended))
                if isinstance(output, Timed):
                    self.server_s[(name, started)] = output.server_s
                output = untimed(output)
                if output != self.alone[name]:
                    self.failures.append(f"{name}: {str(output)[:300]} != alone {str(self.alone[name])[:300]}")
            if self._stop.is_set():  # the run that was going when stopped overlapped to the end
                return

    def check(self) -> None:
        assert self.failures == [], self.failures[:5]
        assert all(self.latencies.values()), "a bystander never completed a run"


def wait_alone(bystanders: Bystanders, since: float) -> None:
    """Until each innocent request has run IDLE_RUNS_PER_WINDOW times since `since` (its whole run
    after it), and IDLE_WINDOW_S has passed; 30 s at most."""
    while time.monotonic() < since + 30:
        done = min(sum(start >= since for start, _ in runs) for runs in list(bystanders.runs.values()))
        if done >= IDLE_RUNS_PER_WINDOW and time.monotonic() >= since + IDLE_WINDOW_S:
            return
        time.sleep(0.05)


def split_runs(
    runs: dict[str, list[tuple[float, float]]], idle_windows: list[tuple[float, float]]
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(idle, loaded) latencies: a run wholly inside an idle window is idle, any other is loaded
    (it overlapped hostile requests)."""
    idle: dict[str, list[float]] = {name: [] for name in runs}
    loaded: dict[str, list[float]] = {name: [] for name in runs}
    for name, spans in runs.items():
        for started, ended in spans:
            inside = any(low <= started and ended <= high for low, high in idle_windows)
            (idle if inside else loaded)[name].append(ended - started)
    return idle, loaded
