"""Kubernetes manifests for engine replicas behind Envoy, rendered from code as the Envoy config is.

`python -m gateway.k8s --output-dir deploy/k8s` writes:
- `engine.yaml`: the settings ConfigMap (the server's flags as environment variables, the
  OpenTelemetry collector endpoint among them), the engine Deployment (gRPC readiness on the
  server's health, liveness on its `liveness` service, a startup probe while the model loads, a
  termination grace longer than the drain), its headless Service (Envoy resolves every ready pod by
  DNS), a PodDisruptionBudget and a HorizontalPodAutoscaler on the queue size;
- `engine-gpu.yaml`: the same Deployment for one NVIDIA GPU per replica (apply instead of the CPU one);
- `gateway.yaml`: Envoy's config (rendered by `gateway.config` for that DNS discovery), its
  Deployment and Service.
A test validates every manifest against Kubernetes' schemas and the Envoy config with Envoy.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway import yaml_text
from gateway.config import GatewayConfig, render_yaml

NAME = "inference-service"
ENGINE = f"{NAME}-engine"
GATEWAY = f"{NAME}-gateway"
GRPC_PORT = 50051
METRICS_PORT = 9000
REST_PORT = 8080
DRAIN_S = 90  # --graceful-termination-timeout: in-flight requests get this long after SIGTERM
ENVOY_IMAGE = "envoyproxy/envoy:v1.40.0"  # the version the gateway extra installs and the tests run


@dataclass(frozen=True)
class Deployment:
    """What an operator changes: names, image, model, sizes and the collector."""

    namespace: str = "default"
    image: str = "ghcr.io/example/inference-service:latest"
    model_id: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    replicas: int = 2
    max_replicas: int = 8
    queue_per_replica: int = 4  # the autoscaler adds replicas when the average queue is above this
    otlp_endpoint: str = "http://otel-collector.observability.svc.cluster.local:4317"

    @property
    def engine_host(self) -> str:
        return f"{ENGINE}.{self.namespace}.svc.cluster.local"


def _labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": NAME, "app.kubernetes.io/component": component}


def _meta(name: str, deployment: Deployment, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": deployment.namespace, "labels": _labels(component)}


def settings(deployment: Deployment) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(f"{NAME}-settings", deployment, "engine"),
        "data": {
            "MODEL_ID": deployment.model_id,
            "GRPC_PORT": str(GRPC_PORT),
            "PROMETHEUS_PORT": str(METRICS_PORT),
            "GRACEFUL_TERMINATION_TIMEOUT": str(DRAIN_S),
            "JSON_OUTPUT": "true",
            "OTLP_ENDPOINT": deployment.otlp_endpoint,
        },
    }


def _grpc_probe(service: str | None, period_s: int, failures: int) -> dict[str, Any]:
    grpc: dict[str, Any] = {"port": GRPC_PORT}
    if service:
        grpc["service"] = service
    return {"grpc": grpc, "periodSeconds": period_s, "failureThreshold": failures, "timeoutSeconds": 2}


def engine_deployment(deployment: Deployment, gpu: bool = False) -> dict[str, Any]:
    resources: dict[str, Any] = {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}}
    args = ["serve", "--hostname", "0.0.0.0"]  # flags win over the pod's own HOSTNAME variable
    pod: dict[str, Any] = {}
    if gpu:
        resources = {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "32Gi", "nvidia.com/gpu": 1}}
        args += ["--device", "cuda"]
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    container = {
        "name": "engine",
        "image": deployment.image,
        "args": args,
        "envFrom": [{"configMapRef": {"name": f"{NAME}-settings"}}],
        "ports": [{"name": "grpc", "containerPort": GRPC_PORT}, {"name": "metrics", "containerPort": METRICS_PORT}],
        # Loading may take minutes: the startup probe gives it 20 minutes before liveness counts.
        "startupProbe": _grpc_probe("liveness", 10, 120),
        "livenessProbe": _grpc_probe("liveness", 10, 3),  # SERVING while loading and draining
        "readinessProbe": _grpc_probe(None, 2, 1),  # NOT_SERVING while loading and draining
        "resources": resources,
    }
    template = {
        "metadata": {
            "labels": _labels("engine"),
            "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT)},
        },
        # SIGTERM drains for DRAIN_S; the grace must outlast it or in-flight requests are killed.
        "spec": {"terminationGracePeriodSeconds": DRAIN_S + 30, "containers": [container], **pod},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(ENGINE, deployment, "engine"),
        "spec": {"replicas": deployment.replicas, "selector": {"matchLabels": _labels("engine")}, "template": template},
    }


def engine_service(deployment: Deployment) -> dict[str, Any]:
    """Headless: DNS answers every ready pod's address, which Envoy's cluster balances over."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(ENGINE, deployment, "engine"),
        "spec": {
            "clusterIP": "None",
            "selector": _labels("engine"),
            "ports": [{"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "appProtocol": "grpc"}],
        },
    }


def disruption_budget(deployment: Deployment) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(ENGINE, deployment, "engine"),
        "spec": {"minAvailable": 1, "selector": {"matchLabels": _labels("engine")}},
    }


def autoscaler(deployment: Deployment) -> dict[str, Any]:
    """Scale on `tgi_queue_size` per pod (served to the metrics API by e.g. prometheus-adapter)."""
    metric = {
        "type": "Pods",
        "pods": {
            "metric": {"name": "tgi_queue_size"},
            "target": {"type": "AverageValue", "averageValue": str(deployment.queue_per_replica)},
        },
    }
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(ENGINE, deployment, "engine"),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": ENGINE},
            "minReplicas": 1,
            "maxReplicas": deployment.max_replicas,
            "metrics": [metric],
            # A new replica loads a model for a while: don't scale down on a short lull.
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
        },
    }


def envoy_config(deployment: Deployment) -> GatewayConfig:
    return GatewayConfig(
        hostname="0.0.0.0",
        port=REST_PORT,
        upstream_host=deployment.engine_host,
        upstream_port=GRPC_PORT,
        admin_port=9901,
        otlp_endpoint=deployment.otlp_endpoint,
        otlp_service_name=GATEWAY,
    )


def gateway_manifests(deployment: Deployment) -> list[dict[str, Any]]:
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(GATEWAY, deployment, "gateway"),
        "data": {"envoy.yaml": render_yaml(envoy_config(deployment))},
    }
    container = {
        "name": "envoy",
        "image": ENVOY_IMAGE,
        "args": ["--config-path", "/etc/envoy/envoy.yaml", "--disable-hot-restart", "--log-level", "warning"],
        "ports": [{"name": "http", "containerPort": REST_PORT}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10},
        "volumeMounts": [{"name": "config", "mountPath": "/etc/envoy", "readOnly": True}],
        "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
    }
    envoy = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(GATEWAY, deployment, "gateway"),
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": _labels("gateway")},
            "template": {
                "metadata": {"labels": _labels("gateway")},
                "spec": {"containers": [container], "volumes": [{"name": "config", "configMap": {"name": GATEWAY}}]},
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(NAME, deployment, "gateway"),
        "spec": {"selector": _labels("gateway"), "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
    }
    return [config_map, envoy, service]


def manifests(deployment: Deployment) -> dict[str, list[dict[str, Any]]]:
    """{file name: its documents}."""
    return {
        "engine.yaml": [
            settings(deployment),
            engine_deployment(deployment),
            engine_service(deployment),
            disruption_budget(deployment),
            autoscaler(deployment),
        ],
        "engine-gpu.yaml": [engine_deployment(deployment, gpu=True)],
        "gateway.yaml": gateway_manifests(deployment),
    }


HEADER = "# Rendered by gateway/k8s.py (`python -m gateway.k8s --help`); edit the code, not this file.\n"


def render_files(deployment: Deployment) -> dict[str, str]:
    return {
        name: HEADER + "---\n".join(yaml_text.dump(doc) for doc in docs) for name, docs in manifests(deployment).items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.k8s", description=__doc__.split("\n\n")[0])
    defaults = Deployment()
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--namespace", default=defaults.namespace)
    parser.add_argument("--image", default=defaults.image)
    parser.add_argument("--model-id", default=defaults.model_id)
    parser.add_argument("--replicas", type=int, default=defaults.replicas)
    parser.add_argument("--otlp-endpoint", default=defaults.otlp_endpoint)
    args = parser.parse_args(argv)
    deployment = Deployment(
        namespace=args.namespace,
        image=args.image,
        model_id=args.model_id,
        replicas=args.replicas,
        otlp_endpoint=args.otlp_endpoint,
    )
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for name, text in render_files(deployment).items():
        (args.output_dir / name).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
