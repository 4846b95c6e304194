"""The Kubernetes manifests in deploy/k8s: fresh renderings of gateway/k8s.py, valid against
Kubernetes' own schemas (offline, strict: no unknown field), consistent with each other, and the
Envoy config they carry accepted by Envoy."""

from __future__ import annotations

import subprocess

import kubernetes_validate
import pytest
import yaml

from gateway import k8s
from gateway.config import render_yaml

K8S_DIR = k8s.Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33"  # a release with native gRPC probes (GA in 1.27) and autoscaling/v2


def _documents() -> dict[str, list[dict]]:
    return {
        name: [doc for doc in yaml.safe_load_all((K8S_DIR / name).read_text()) if doc]
        for name in k8s.render_files(k8s.Deployment())
    }


def test_committed_manifests_are_fresh():
    for name, text in k8s.render_files(k8s.Deployment()).items():
        assert (K8S_DIR / name).read_text() == text, f"stale: python -m gateway.k8s --output-dir deploy/k8s ({name})"


@pytest.mark.parametrize("name", sorted(k8s.render_files(k8s.Deployment())))
def test_every_manifest_is_valid_kubernetes(name):
    documents = _documents()[name]
    assert documents
    for document in documents:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)  # raises when invalid


def test_a_broken_manifest_is_caught():
    deployment = k8s.engine_deployment(k8s.Deployment())
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # a typo'd field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_pieces_fit_together():
    engine = {doc["kind"]: doc for doc in _documents()["engine.yaml"]}
    pod = engine["Deployment"]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert (
        pod["metadata"]["labels"]
        == engine["Service"]["spec"]["selector"]
        == engine["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]
    )
    assert engine["Service"]["spec"]["clusterIP"] == "None"  # headless: DNS lists every ready pod
    drain_s = int(engine["ConfigMap"]["data"]["GRACEFUL_TERMINATION_TIMEOUT"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > drain_s
    assert container["readinessProbe"]["grpc"] == {"port": k8s.GRPC_PORT}
    assert (
        container["livenessProbe"]["grpc"]
        == container["startupProbe"]["grpc"]
        == {"port": k8s.GRPC_PORT, "service": "liveness"}
    )
    assert engine["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"] == "tgi_queue_size"
    (gpu,) = _documents()["engine-gpu.yaml"]
    assert gpu["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    config_map, envoy, _ = _documents()["gateway.yaml"]
    envoy_yaml = yaml.safe_load(config_map["data"]["envoy.yaml"])
    cluster = next(c for c in envoy_yaml["static_resources"]["clusters"] if c["name"] == "textgen")
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert cluster["type"] == "STRICT_DNS" and address == {
        "address": f"{k8s.ENGINE}.default.svc.cluster.local",
        "port_value": k8s.GRPC_PORT,
    }
    collector = next(c for c in envoy_yaml["static_resources"]["clusters"] if c["name"] != "textgen")
    collector_address = collector["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    host, port = collector_address["socket_address"]["address"], collector_address["socket_address"]["port_value"]
    assert engine["ConfigMap"]["data"]["OTLP_ENDPOINT"] == f"http://{host}:{port}"  # one collector for both
    assert envoy["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] == config_map["metadata"]["name"]


def test_envoy_accepts_the_kubernetes_config(tmp_path):
    from gateway.envoy import GatewayError, envoy_binary

    try:
        binary = envoy_binary()
    except GatewayError:
        pytest.skip("envoy is not installed (the gateway extra)")
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(k8s.envoy_config(k8s.Deployment())))
    result = subprocess.run(
        [binary, "--mode", "validate", "-c", str(path), "-l", "error"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr
