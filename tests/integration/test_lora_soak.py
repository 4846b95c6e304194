"""Soak: LoRA adapters loaded and unloaded over and over through the gRPC RPCs while the base and
three adapters stream without pause.

`alpha` stays resident; `beta` and `gamma` are unloaded and loaded again every cycle, and `beta`
comes back with `gamma`'s weights every other cycle (the same name, other weights: the prefix cache
must not hand it the old weights' KV blocks). Client threads stream the same prompt on the base, on
alpha, on beta and on gamma the whole time. Checked, whatever the interleaving:
- every stream ends once: either all its tokens then one final message, or NOT_FOUND before any token
  (only on beta or gamma, while unloaded); nothing else, and never an error after a token;
- every finished stream's tokens are its adapter's greedy output, as served alone at the start (beta:
  its own weights' or gamma's);
- every load and unload succeeds (an unload waits for the streams running on the adapter), and
  requests really ran on the cycled adapters;
- afterwards nothing runs or waits and every KV block is free.

Only with `pytest -m soak tests/integration/test_lora_soak.py` (2-3 minutes on a busy 2-core machine).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter

import grpc
import pytest

from tests.conftest import GrpcServerThread
from tests.lora_adapters import make_adapter
from textgen.v1 import generate_pb2 as pb

pytestmark = pytest.mark.soak

PROMPT = "the quick brown fox jumps over the lazy dog " * 4  # several full KV blocks: the prefix cache serves them
NEW_TOKENS = 16
CYCLES = 30
STREAMS_PER_NAME = 2  # client threads per name (base, alpha, beta, gamma)
LOADED_S = 0.4  # how long each cycle keeps beta and gamma loaded


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-soak")
    return {
        "alpha": make_adapter(tiny_model_dir, root / "alpha", seed=31),
        "beta": make_adapter(tiny_model_dir, root / "beta", seed=32, rank=4, targets=["q_proj", "v_proj"]),
        "gamma": make_adapter(tiny_model_dir, root / "gamma", seed=33, rank=16, alpha=8, targets=["gate_proj"]),
    }


def _stream(stub, adapter: str | None) -> tuple[str, list[int] | grpc.StatusCode]:
    """('done', tokens) for a stream that finished, or ('refused', code) for one that ended in an
    error before any token; an error after a token, or a stream without a final message, fails."""
    parameters = pb.GenerateParameters(max_new_tokens=NEW_TOKENS, details=True)
    if adapter is not None:
        parameters.adapter_id = adapter
    tokens: list[int] = []
    final = None
    try:
        for message in stub.GenerateStream(pb.GenerateRequest(inputs=PROMPT, parameters=parameters), timeout=120):
            assert final is None, "a message after the final one"
            tokens.append(message.token.id)
            if message.HasField("details"):
                final = message
    except grpc.RpcError as error:
        assert not tokens, f"{adapter}: {error.code()} after {len(tokens)} tokens: {error.details()}"
        return "refused", error.code()
    assert final is not None, f"{adapter}: the stream ended without its final message"
    assert final.details.generated_tokens == len(tokens) and final.details.finish_reason in ("length", "eos_token")
    return "done", tokens


def test_adapters_load_and_unload_under_streaming_load(tiny_engine_config, adapter_dirs, monkeypatch):
    monkeypatch.setenv("INFERENCE_SERVICE_TEST_STEP_DELAY_MS", "5")  # streams overlap the loads and unloads
    model = dataclasses.replace(
        tiny_engine_config.model,
        lora_adapters=",".join(f"{name}={path}" for name, path in adapter_dirs.items()),
        max_loras=3,
    )
    server = GrpcServerThread(dataclasses.replace(tiny_engine_config, model=model))
    try:
        stub = server.stub
        expected = {name: _stream(stub, name)[1] for name in (None, "alpha", "beta", "gamma")}
        assert len({tuple(tokens) for tokens in expected.values()}) == 4  # each adapter changes the output
        allowed = {name: [tokens] for name, tokens in expected.items()}
        allowed["beta"].append(expected["gamma"])  # beta comes back with gamma's weights every other cycle

        stop = threading.Event()
        outcomes: list[tuple[str | None, str, object]] = []
        failures: list[BaseException] = []
        lock = threading.Lock()

        def client(adapter: str | None) -> None:
            channel = grpc.insecure_channel(server.target)
            own = type(stub)(channel)
            try:
                while not stop.is_set():
                    kind, value = _stream(own, adapter)
                    with lock:
                        outcomes.append((adapter, kind, value))
                    if kind == "refused":
                        time.sleep(0.02)
            except BaseException as error:  # reported by the main thread
                failures.append(error)
            finally:
                channel.close()

        clients = [
            threading.Thread(target=client, args=(name,), daemon=True)
            for name in (None, "alpha", "beta", "gamma")
            for _ in range(STREAMS_PER_NAME)
        ]
        for thread in clients:
            thread.start()
        try:
            for cycle in range(CYCLES):
                for name in ("beta", "gamma"):
                    stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name=name), timeout=120)
                time.sleep(LOADED_S / 4)  # unloaded for a while: requests naming them are refused
                beta_weights = adapter_dirs["gamma" if cycle % 2 == 0 else "beta"]
                stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="beta", lora_path=str(beta_weights)))
                stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="gamma", lora_path=str(adapter_dirs["gamma"])))
                time.sleep(LOADED_S)
        finally:
            stop.set()
            for thread in clients:
                thread.join(120)
        assert not failures, failures[0]
        assert not any(thread.is_alive() for thread in clients)

        done = Counter(adapter for adapter, kind, _ in outcomes if kind == "done")
        for adapter, kind, value in outcomes:
            if kind == "done":
                assert value in allowed[adapter], adapter
            else:
                assert adapter in ("beta", "gamma") and value == grpc.StatusCode.NOT_FOUND, (adapter, value)
        assert min(done[name] for name in ("beta", "gamma")) >= CYCLES // 3, done  # they really served between unloads
        assert min(done[name] for name in (None, "alpha")) >= CYCLES, done
        stats = server.wait_idle(30)
        assert stats.num_running == stats.num_waiting == 0
        assert stats.num_free_blocks == stats.num_total_blocks  # no KV block leaked
        assert [a.id for a in stub.Info(pb.InfoRequest(), timeout=10).lora_adapters] == ["alpha", "beta", "gamma"]
    finally:
        server.stop(timeout_s=5.0)
