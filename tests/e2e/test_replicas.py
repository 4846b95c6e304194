"""`launch --num-replicas 2`: requests spread over both replicas, REST and gRPC through Envoy's one
port; SIGKILL one under load and nothing is lost beyond typed errors of what it had in flight, and
/health stays 200 (the other replica serves); it is restarted and serves again; SIGTERM stops
everything. `--routing prefix` keeps a prompt's prefix on one replica (launched with an API key from
`--api-key-file`, which every replica checks and no command line shows). A replica whose engine-core
process dies ends its streams with typed error events while the other one serves."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
from rest_helpers import engine_core_of, finish_stream, openai_chunks, sse_events, start_stream

from tests.launched import Launched, alive
from textgen.v1 import generate_pb2 as pb
from textgen.v1 import generate_pb2_grpc

READY = r"ready: TGI REST API on (http://\S+) \(gRPC too\), balanced over (\d+) replicas"
REPLICA = r"replica (\d+) \(pid (\d+)\): gRPC port (\d+)"
AFTER_THE_KILL = 16  # prompts sent once a replica's engine core is dead
RETRY_STATS = r"textgen\.(upstream_rq|upstream_cx|health_check)"  # what a failed retry met


def generate(
    url: str, inputs: str, max_new_tokens: int = 8, timeout: float = 60, headers: dict[str, str] | None = None
) -> tuple[int, dict]:
    body = json.dumps({"inputs": inputs, "parameters": {"max_new_tokens": max_new_tokens}}).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url + "/generate", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def health_status(url: str) -> int:
    """REST /health's status (0: no answer at all)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


class HealthPoller(threading.Thread):
    """Asks REST /health again and again until stopped; `statuses` holds the answers."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.statuses, self._stop_event = url, [], threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.statuses.append(health_status(self.url))
            time.sleep(0.01)

    def stop(self) -> Counter:
        self._stop_event.set()
        self.join(60)
        return Counter(self.statuses)


def wait_envoy_sees_healthy(run: Launched, count: int = 2, timeout_s: float = 30) -> None:
    """Until Envoy's active health checks pass on `count` engine endpoints (its admin /clusters)."""
    admin = run.wait_for(r"Envoy \d+: REST on port \d+, admin (\S+)").group(1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(admin + "/clusters", timeout=5) as response:
            lines = response.read().decode().splitlines()
        flags = [
            line.rsplit("::", 1)[1] for line in lines if line.startswith("textgen::") and "::health_flags::" in line
        ]
        if len(flags) == 2 and flags.count("healthy") >= count:
            time.sleep(1.5)  # Envoy merges host updates over 1 s before its balancer uses them
            return
        time.sleep(0.2)
    raise AssertionError(f"Envoy did not see {count} healthy replicas: {flags}")


def steps_of(port: int) -> int:
    """Engine steps a replica has run (its own gRPC Info, straight to its port)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        info = generate_pb2_grpc.TextGenerationStub(channel).Info(pb.InfoRequest(), timeout=10)
    return info.stats.num_steps


def replicas_of(run: Launched) -> dict[int, tuple[int, int]]:
    """{index: (pid, port)} of the replicas' latest starts."""
    return {int(m.group(1)): (int(m.group(2)), int(m.group(3))) for m in run.matches(REPLICA)}


def test_two_replicas_share_the_load_survive_a_kill_and_stop(launched):
    run = launched("--num-replicas", "2")
    url = run.wait_for(READY).group(1)
    wait_envoy_sees_healthy(run)
    replicas = replicas_of(run)
    assert sorted(replicas) == [0, 1]

    # Load spreads over both (least request: a request goes to the replica with fewer in flight;
    # Envoy's balancer takes a moment to use a replica its health checks just let in).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(steps_of(port) for _, port in replicas.values()):
        results: list[tuple[int, dict]] = []
        threads = [
            threading.Thread(target=lambda i=i, out=results: out.append(generate(url, f"hello {i}", 64)))
            for i in range(8)
        ]
        for thread in threads:
            thread.start()
            time.sleep(0.02)
        for thread in threads:
            thread.join(60)
        assert [status for status, _ in results] == [200] * 8
    assert all(steps_of(port) > 0 for _, port in replicas.values())

    # gRPC through the same port as REST.
    with grpc.insecure_channel(url.removeprefix("http://")) as channel:
        reply = generate_pb2_grpc.TextGenerationStub(channel).Generate(
            pb.GenerateRequest(inputs="hello", parameters=pb.GenerateParameters(max_new_tokens=3)), timeout=30
        )
    assert reply.generated_text

    # SIGKILL replica 1 while requests are in flight.
    outcomes: list[tuple[int, dict]] = []
    load = [threading.Thread(target=lambda i=i: outcomes.append(generate(url, f"load {i}", 40))) for i in range(16)]
    for thread in load:
        thread.start()
    time.sleep(0.3)
    poller = HealthPoller(url)  # asked throughout the death and the restart
    poller.start()
    killed_pid, killed_port = replicas[1]
    os.kill(killed_pid, signal.SIGKILL)
    for thread in load:
        thread.join(90)
    assert len(outcomes) == 16, "a request hung"
    failures = [(status, body) for status, body in outcomes if status != 200]
    assert all(status >= 500 and body.get("error") for status, body in failures), failures  # typed errors
    assert len(failures) < 16 and all(
        body.get("generated_text") is not None for status, body in outcomes if status == 200
    )

    # Restarted on the same port, it serves again; nothing is lost meanwhile.
    run.wait_for(r"replica 1 restarted \(pid (\d+)\): serving again", timeout_s=60)
    health = poller.stop()
    assert set(health) == {200} and health[200] > 10, health  # it flapped to 503 before
    new_pid, port = replicas_of(run)[1]
    assert new_pid != killed_pid and port == killed_port
    wait_envoy_sees_healthy(run)
    deadline = time.monotonic() + 30
    while steps_of(port) == 0 and time.monotonic() < deadline:
        generate(url, "after the restart", 4)
    assert steps_of(port) > 0
    assert generate(url, "hello", 3)[0] == 200

    run.process.send_signal(signal.SIGTERM)
    assert run.process.wait(30) == 0, run.log()
    assert not any(alive(pid) for pid, _ in replicas_of(run).values())


def test_prefix_routing_keeps_a_prefix_on_one_replica(launched, tmp_path):
    key = "s3cret-Key"
    key_file = tmp_path / "api-key"
    key_file.write_text(key + "\n")
    run = launched("--num-replicas", "2", "--routing", "prefix", "--api-key-file", str(key_file))
    url = run.wait_for(READY).group(1)
    wait_envoy_sees_healthy(run)
    # The key: on no command line (what `ps` shows; replicas had it there), in the replicas' environment.
    replica_pids = [pid for pid, _ in replicas_of(run).values()]
    for pid in [run.process.pid, *replica_pids]:
        assert key not in Path(f"/proc/{pid}/cmdline").read_bytes().decode("utf-8", "replace")
    for pid in replica_pids:
        assert f"API_KEY={key}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    auth = {"Authorization": f"Bearer {key}"}
    assert generate(url, "no key", 2)[0] == 401

    ports = [port for _, port in replicas_of(run).values()]
    deadline = time.monotonic() + 30  # different prefixes land on both (once Envoy uses both)
    while time.monotonic() < deadline and not all(steps_of(port) for port in ports):
        for index in range(20):
            assert generate(url, f"{index} a different conversation", 2, headers=auth)[0] == 200
    assert all(steps_of(port) for port in ports)  # both replicas took the key
    shared = "You are a helpful assistant who answers in rhymes. " * 6  # longer than the hashed prefix
    before = [steps_of(port) for port in ports]
    for turn in range(6):
        assert generate(url, shared + f"question {turn}?", 2, headers=auth)[0] == 200
    moved = [steps_of(port) - count for port, count in zip(ports, before, strict=True)]
    assert sorted(moved)[0] == 0 and sorted(moved)[1] > 0, moved  # every turn on the same replica


def generated_on(port: int, inputs: str, max_new_tokens: int) -> str:
    """A replica's own answer (its gRPC port, not through Envoy)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = pb.GenerateRequest(inputs=inputs, parameters=pb.GenerateParameters(max_new_tokens=max_new_tokens))
        return generate_pb2_grpc.TextGenerationStub(channel).Generate(request, timeout=60).generated_text


def envoy_stats(run: Launched, prefix: str) -> dict[str, str]:
    """Envoy's nonzero counters under `prefix` of the engine cluster (what its retries met)."""
    admin = run.wait_for(r"Envoy \d+: REST on port \d+, admin (\S+)").group(1)
    with urllib.request.urlopen(f"{admin}/stats?filter=cluster\\.{prefix}", timeout=5) as response:
        lines = response.read().decode().splitlines()
    return dict(line.split(": ", 1) for line in lines if not line.endswith(": 0"))


def running_on(port: int) -> int:
    """Requests running on a replica now (its own gRPC Info)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        info = generate_pb2_grpc.TextGenerationStub(channel).Info(pb.InfoRequest(), timeout=10)
    return info.stats.num_running


def test_a_dead_engine_core_ends_its_streams_with_error_events_while_the_other_replica_serves(launched):
    """SIGKILL (a segfault, the OOM killer) of one replica's engine-core process: its TGI and OpenAI
    streams end with typed error events, it goes NOT_SERVING and exits 1 (and is restarted), /health
    stays 200 and the other replica serves throughout."""
    run = launched("--num-replicas", "2", "--routing", "prefix")  # a prompt picks its replica
    url = run.wait_for(READY).group(1)
    wait_envoy_sees_healthy(run)
    replicas = replicas_of(run)
    tgi = start_stream(url + "/generate_stream", {"inputs": "a conversation", "parameters": {"max_new_tokens": 400}})
    [(index, (pid, port))] = [item for item in replicas.items() if running_on(item[1][1]) == 1]
    for attempt in range(30):  # an OpenAI stream whose prompt lands on the same replica
        body = {"prompt": f"another conversation {attempt}", "max_tokens": 400, "stream": True}
        openai = start_stream(url + "/v1/completions", body)
        if running_on(port) == 2:
            break
        openai[0].kill()  # on the other replica: a client that went away
        openai[0].wait()
    assert running_on(port) == 2
    [(other_pid, other_port)] = [value for key, value in replicas.items() if key != index]
    poller = HealthPoller(url)
    poller.start()
    os.kill(engine_core_of(pid), signal.SIGKILL)
    tgi_result, openai_result = finish_stream(*tgi), finish_stream(*openai)

    assert tgi_result.returncode == 0, tgi_result.stderr  # a whole body with its last event, not a cut one
    events = sse_events(tgi_result.stdout)
    assert events[-1].keys() == {"error", "error_type"} and events[-1]["error_type"] == "unavailable", events[-1]
    assert "the engine core process was killed by SIGKILL" in events[-1]["error"]
    assert openai_result.returncode == 0, openai_result.stderr
    errors = [chunk["error"] for chunk in openai_chunks(openai_result.stdout) if "error" in chunk]
    assert [(error["type"], error["code"]) for error in errors] == [("server_error", "unavailable")]

    # The other replica serves meanwhile; the failed one exits 1 and is started again.
    before = steps_of(other_port)
    # Prompts hashed anywhere on the ring, the dead replica's share included, all at once (with
    # /health asked beside them): each is refused there before admission and retried on the live one.
    prompts = [f"meanwhile, elsewhere {i}" for i in range(AFTER_THE_KILL)]
    with concurrent.futures.ThreadPoolExecutor(AFTER_THE_KILL) as pool:
        answers = list(pool.map(lambda prompt: generate(url, prompt, 4), prompts))
    failures = [answer for answer in answers if answer[0] != 200]
    assert not failures, f"{failures}; Envoy's counters: {envoy_stats(run, RETRY_STATS)}"
    expected = [generated_on(other_port, prompt, 4) for prompt in prompts]  # greedy: the same text
    assert [body["generated_text"] for _, body in answers] == expected
    assert steps_of(other_port) > before and alive(other_pid)
    run.wait_for(rf"replica {index} \(pid {pid}\) exited with code 1: restarting", timeout_s=60)
    run.wait_for(rf"replica {index} restarted \(pid (\d+)\): serving again", timeout_s=90)
    health = poller.stop()
    assert set(health) == {200}, health
    wait_envoy_sees_healthy(run)
    assert generate(url, "a conversation", 3)[0] == 200  # the restarted replica serves its prefix again
