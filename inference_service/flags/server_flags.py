"""The server's flags: the gRPC listener, shutdown, logging, the engine-core process, tracing, API
keys, TLS and metrics."""

from __future__ import annotations

from inference_service.flags.flag import Flag, parse_bool, parse_bool_value, read_secret_file

SERVER_FLAGS = (
    Flag("--hostname", "server.hostname", "Address the gRPC server listens on."),
    Flag("--grpc-port", "server.grpc_port", "gRPC port (0 = any free port, logged once bound).", int),
    Flag("--payload-limit", "server.payload_limit", "Largest request message in bytes.", int),
    Flag(
        "--graceful-termination-timeout",
        "server.graceful_termination_timeout",
        "Seconds in-flight requests get to finish after SIGTERM; the rest are cancelled.",
        float,
        short="-g",
    ),
    Flag("--json-output", "server.json_output", "Log JSON lines instead of text.", parse_bool),
    Flag("--log-level", "server.log_level", "debug, info, warning or error."),
    Flag(
        "--engine-core-process",
        "server.engine_core_process",
        "Run the scheduler and the model in a child process of the server (true or false): if it dies "
        "(a crash, the OOM killer), the calls in flight end with UNAVAILABLE (REST: an error event) and "
        "the server reports NOT_SERVING and exits 1. With LoRA adapters or --num-shard the engine stays "
        "in the server process.",
        parse_bool_value,
        default_text="true",
    ),
    Flag(
        "--otlp-endpoint",
        "server.otlp_endpoint",
        "OTLP/gRPC collector to export traces to, e.g. http://127.0.0.1:4317 (launch: Envoy's too); "
        "unset, nothing is traced.",
        default_text="none",
    ),
    Flag(
        "--otlp-service-name",
        "server.otlp_service_name",
        'service.name of exported traces (launch: Envoy\'s spans get it + "-gateway").',
    ),
    Flag(
        "--api-key",
        "server.api_key",
        "Key that generation and tokenization need, sent as 'Authorization: Bearer <key>' (or Anthropic's "
        "'x-api-key: <key>'): TGI's REST /, /invocations, /generate, /generate_stream, /tokenize, OpenAI's "
        "/v1/chat/completions, /v1/completions, /v1/responses (and GET/DELETE /v1/responses/{id}) and "
        "Anthropic's /v1/messages, /v1/messages/count_tokens, vLLM's /v1/load_lora_adapter, "
        "/v1/unload_lora_adapter (gRPC Generate, GenerateStream, CompatGenerate, "
        "Tokenize, ChatCompletion, ChatCompletionStream, Completion, CompletionStream, CreateResponse, "
        "CreateResponseStream, GetResponse, DeleteResponse, Messages, MessagesStream, CountMessageTokens, "
        "LoadLoraAdapter, UnloadLoraAdapter). "
        "Open without it, as in "
        "TGI: /health, /info, /metrics, /v1/models, /docs, "
        "/openapi.json (gRPC Health, Info, Metrics, ListModels, GetModel, the health service, reflection).",
        default_text="none: nothing is checked",
    ),
    Flag(
        "--api-key-file",
        "server.api_key",
        "A file holding the --api-key (or give it as the API_KEY variable): a key on the command line "
        "is visible to every user of the machine (ps). Either way, replicas get it through their "
        "environment, never their command line.",
        read_secret_file,
        alias_of="--api-key",
        default_text="none",
    ),
    Flag(
        "--tls-cert",
        "server.tls_cert",
        "TLS on the gRPC port (launch: on Envoy's port too, and from Envoy to the engine): the server's "
        "certificate chain, PEM. For a test CA with server and client certificates: python -m gateway.certs --out DIR.",
        default_text="none: plaintext",
    ),
    Flag("--tls-key", "server.tls_key", "The private key of --tls-cert, PEM.", default_text="none"),
    Flag(
        "--tls-client-ca",
        "server.tls_client_ca",
        "Mutual TLS: callers must present a certificate signed by this CA (PEM).",
        default_text="none: no client certificates",
    ),
    Flag(
        "--prometheus-port",
        "server.prometheus_port",
        "Port of the Prometheus metrics listener on --hostname (0 = any free port); the Metrics RPC "
        "(GET /metrics through the gateway) serves the same metrics.",
        int,
    ),
)
