"""Replicas behind Envoy, as rendered: the engine cluster (endpoints, balancing, health checks,
outlier detection), safe retries and prefix hashing on the routes, the replicas' command lines,
and the flags that carry a launch's settings over to them. Envoy validates the configs."""

from __future__ import annotations

import subprocess

import pytest

from gateway.config import GatewayConfig, render, render_yaml
from gateway.replicas import ReplicaSet, threads_per_replica
from gateway.upstream import PREFIX_HASH_HEADER
from inference_service import flags
from inference_service.api.config import ServerConfig
from inference_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig


def _engine_cluster(config: GatewayConfig) -> dict:
    (cluster,) = [c for c in render(config)["static_resources"]["clusters"] if c["name"] == "textgen"]
    return cluster


def _routes(config: GatewayConfig) -> list[dict]:
    listener = render(config)["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    # Preflights end at the Lua filter; health retries on every replica (tests/unit/test_gateway_limits_config.py).
    return [r for r in routes if "route" in r and r["name"] not in ("preflight", "Health")]


def test_replicas_are_the_cluster_endpoints_with_health_checks_and_outlier_detection():
    cluster = _engine_cluster(GatewayConfig(upstream_ports=(7001, 7002, 7003)))
    endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in endpoints] == [7001, 7002, 7003]
    assert cluster["lb_policy"] == "LEAST_REQUEST" and cluster["type"] == "STATIC"
    (check,) = cluster["health_checks"]
    assert "grpc_health_check" in check and check["no_traffic_interval"] == check["interval"]
    detection = cluster["outlier_detection"]
    assert detection["split_external_local_origin_errors"] and detection["enforcing_consecutive_local_origin_failure"]
    # No gRPC status ejects a replica: a request's own error, a client's expired deadline.
    assert detection["enforcing_consecutive_5xx"] == detection["enforcing_consecutive_gateway_failure"] == 0
    assert _engine_cluster(GatewayConfig(upstream_host="engine.ns.svc"))["type"] == "STRICT_DNS"  # DNS: all pods
    # Every request a dead replica refused at the same moment is retried (Envoy's default: 3 at once).
    (thresholds,) = cluster["circuit_breakers"]["thresholds"]
    assert thresholds["max_retries"] >= 1000


def test_routes_retry_only_what_never_started_and_hash_prefixes_with_prefix_routing():
    for route in _routes(GatewayConfig()):
        policy = route["route"]["retry_policy"]
        # Never on a status alone (UNAVAILABLE, RESOURCE_EXHAUSTED): only the engine's own marker
        # says that it refused the request before admitting it.
        assert set(policy["retry_on"].split(",")) == {
            "connect-failure",
            "reset-before-request",
            "refused-stream",
            "retriable-headers",
        }  # not `cancelled`: a unary call a drain cut is CANCELLED, and it ran
        assert policy["retriable_headers"] == [{"name": "x-textgen-retryable", "string_match": {"exact": "1"}}]
        # Ring hash: every retry walks from the prompt's own entry; the walk must get past a run of
        # the dead replica's entries (each next entry is another replica's about half the time).
        assert policy["host_selection_retry_max_attempts"] >= 32
        assert "hash_policy" not in route["route"]
    prefix = GatewayConfig(upstream_ports=(7001, 7002), routing="prefix")
    assert _engine_cluster(prefix)["lb_policy"] == "RING_HASH"
    assert all(r["route"]["hash_policy"] == [{"header": {"header_name": PREFIX_HASH_HEADER}}] for r in _routes(prefix))
    assert any(r["match"].get("grpc") == {} for r in _routes(prefix))  # gRPC callers use the same port


def test_the_lua_filter_hashes_prefixes_only_with_prefix_routing():
    def lua(config: GatewayConfig) -> str:
        listener = render(config)["static_resources"]["listeners"][0]
        filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
        return next(f for f in filters if f["name"] == "envoy.filters.http.lua")["typed_config"]["default_source_code"][
            "inline_string"
        ]

    assert lua(GatewayConfig(routing="prefix")).startswith("PREFIX_ROUTING = true\n")
    assert "PREFIX_ROUTING = true" not in lua(GatewayConfig())


@pytest.mark.parametrize("routing", ["least-request", "prefix"])
def test_envoy_accepts_replica_configs(tmp_path, routing):
    from gateway.envoy import GatewayError, envoy_binary

    try:
        binary = envoy_binary()
    except GatewayError:
        pytest.skip("envoy is not installed (the gateway extra)")
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(GatewayConfig(upstream_ports=(7001, 7002), routing=routing)))
    result = subprocess.run(
        [binary, "--mode", "validate", "-c", str(path), "-l", "error"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


def test_bad_routing_is_refused():
    with pytest.raises(ValueError, match="routing"):
        GatewayConfig(routing="random")


def test_args_for_gives_back_the_configs():
    engine = EngineConfig(
        model=ModelConfig(model_id="some/model", dtype="float32", trust_remote_code=True),
        cache=CacheConfig(block_size=32, prefix_caching=False),
        scheduler=SchedulerConfig(speculate=3, max_batch_size=8),
    )
    server = ServerConfig(grpc_port=7000, json_output=True, log_level="debug")
    args = flags.args_for(engine, server)
    assert "--max-input-length" not in args  # legacy aliases are never written
    parsed = flags.Parser()
    flags.add_config_flags(parsed)
    assert flags.configs_from_args(parsed.parse_args(args), environ={}) == (engine, server)
    assert flags.args_for(EngineConfig(), ServerConfig()) == []


def test_replicas_share_the_threads_and_get_ports_of_their_own():
    assert threads_per_replica(8, 3) == 2 and threads_per_replica(1, 4) == 1
    engine = EngineConfig(model=ModelConfig(model_id="some/model", num_threads=4))
    replicas = ReplicaSet(engine, ServerConfig(grpc_port=7000, prometheus_port=9100), 2, "127.0.0.1")
    assert replicas.ports == (7000, 7001)
    command = replicas.command(replicas.replicas[1])
    serve = command[command.index("serve") + 1 :]
    assert serve.count("--grpc-port") == serve.count("--num-threads") == serve.count("--prometheus-port") == 1
    assert serve[serve.index("--grpc-port") + 1] == "7001" and serve[serve.index("--num-threads") + 1] == "2"
    assert serve[serve.index("--prometheus-port") + 1] == "9101"
    assert serve[serve.index("--model-id") + 1] == "some/model"
    free = ReplicaSet(engine, ServerConfig(grpc_port=0), 3, "127.0.0.1")
    assert len(set(free.ports)) == 3 and all(free.ports)


def test_on_cuda_each_replica_sees_one_gpu_of_its_own():
    engine = EngineConfig(model=ModelConfig(model_id="some/model", device="cuda:1"))
    replicas = ReplicaSet(engine, ServerConfig(grpc_port=7000), 2, "127.0.0.1")
    first, second = replicas.replicas
    assert replicas.environment(first, {})["CUDA_VISIBLE_DEVICES"] == "0"
    assert replicas.environment(second, {"CUDA_VISIBLE_DEVICES": "2,3", "MAX_BATCH_SIZE": "4"}) == {
        "CUDA_VISIBLE_DEVICES": "3"
    }  # the launcher's settings travel on the command line, not the environment
    command = replicas.command(second)
    assert command[command.index("--device") + 1] == "cuda" and command.count("--device") == 1
    cpu = ReplicaSet(EngineConfig(model=ModelConfig(model_id="m")), ServerConfig(grpc_port=7000), 2, "127.0.0.1")
    assert "CUDA_VISIBLE_DEVICES" not in cpu.environment(cpu.replicas[0], {})


def test_replicas_get_the_api_key_through_their_environment_not_their_command_line():
    engine = EngineConfig(model=ModelConfig(model_id="some/model"))
    replicas = ReplicaSet(engine, ServerConfig(grpc_port=7000, api_key="s3cret-Key"), 2, "127.0.0.1")
    replica = replicas.replicas[0]
    assert not any("s3cret-Key" in arg for arg in replicas.command(replica)) and "--api-key" not in " ".join(
        replicas.command(replica)
    )
    environment = replicas.environment(replica, {"API_KEY": "other", "API_KEY_FILE": "/run/key", "HOME": "/h"})
    assert environment == {"API_KEY": "s3cret-Key", "HOME": "/h"}
    keyless = ReplicaSet(engine, ServerConfig(grpc_port=7000), 2, "127.0.0.1")
    assert "API_KEY" not in keyless.environment(keyless.replicas[0], {"API_KEY": "stale"})
