"""The server's flags: TGI's launcher names, their environment variables, and the config dataclasses
they fill. Shared by the `inference-service` commands (cli.py) and the gateway's `launch`, which sit
above this module and import it; it imports neither.

Each flag can also come from the SCREAMING_SNAKE_CASE environment variable of the same name
(`--max-total-tokens` ⇄ `MAX_TOTAL_TOKENS`); a flag wins over its variable, and either wins over the
config dataclass default.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from inference_service.api.config import ServerConfig
from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig, SchedulerConfig
from inference_service.observability import logging as observability_logging

# Which dataclass each flag group fills.
AREAS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "limits": LimitsConfig,
    "server": ServerConfig,
}


class CliError(Exception):
    """A user mistake in flags or variables; the message is the whole story."""


class CommandFailed(Exception):
    """The command could not do its job (port taken, ...); the message says why."""


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, not {text!r}")


def read_secret_file(path: str) -> str:
    """A secret kept in a file (`--api-key-file`): its text, without the line end an editor adds."""
    try:
        return Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError):
        raise ValueError(f"cannot read {path!r}") from None


def parse_bool_value(text: str) -> bool:
    """A flag that takes `true` or `false` as its value (TGI's `--sharded <true|false>`), unlike a switch."""
    return parse_bool(text)


_TYPE_NAMES = {
    parse_bool_value: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    parse_bool: "true or false",
    read_secret_file: "a readable file",
}


class NamedFlag:
    """A flag's environment variable and argparse dest, both derived from its name (TGI's rule)."""

    name: str

    @property
    def env(self) -> str:
        return self.name.lstrip("-").replace("-", "_").upper()

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Flag(NamedFlag):
    """One command-line flag, the config field it sets, and its environment variable."""

    name: str  # "--max-total-tokens"
    target: str  # "limits.max_total_tokens"
    help: str
    type: Callable[[str], Any] = str
    short: str | None = None
    alias_of: str | None = None  # another flag setting the same field: a legacy name, a file (both given = error)
    default_text: str | None = None  # what an unset default (None) means, for --help

    @property
    def is_bool(self) -> bool:
        return self.type is parse_bool

    def default(self) -> Any:
        area, field_name = self.target.split(".")
        fields = {f.name: f for f in dataclasses.fields(AREAS[area])}
        field = fields[field_name]
        return field.default if field.default is not dataclasses.MISSING else field.default_factory()


MODEL_FLAGS = (
    Flag(
        "--model-id",
        "model.model_id",
        "Model to serve: a hub id (org/name), a local transformers folder or a .gguf file. "
        "The default is the demo model, fetched and converted on first use.",
    ),
    Flag(
        "--revision",
        "model.revision",
        "Hub revision: a commit, branch or tag (hub ids only).",
        default_text="the default branch",
    ),
    Flag(
        "--dtype",
        "model.dtype",
        "Weights, KV cache and compute dtype: auto, float32, bfloat16 or float16. "
        "auto is float32 on CPU and bfloat16 (float16 without bf16 support) on CUDA. On CPU, a bfloat16 "
        "model's decode steps run a native bf16 kernel (AVX512-BF16 where the CPU has it).",
    ),
    Flag("--device", "model.device", "Where the model runs: auto, cpu, cuda or cuda:N."),
    Flag(
        "--trust-remote-code",
        "model.trust_remote_code",
        "Allow model code from the model's repository (only for models you trust).",
        parse_bool,
    ),
    Flag("--num-threads", "model.num_threads", "Torch intra-op threads on CPU.", int, default_text="torch's choice"),
    Flag(
        "--huggingface-hub-cache",
        "model.huggingface_hub_cache",
        "Hub cache folder.",
        default_text="the hub's, e.g. ~/.cache/huggingface/hub",
    ),
    Flag(
        "--chat-template",
        "model.chat_template",
        "A Jinja chat template file (or a tokenizer_config.json holding one) for /v1/chat/completions, "
        "replacing the model's own.",
        default_text="the model's",
    ),
    Flag(
        "--reasoning-parser",
        "model.reasoning_parser",
        "How the model writes its thoughts, split from the answer into `reasoning_content` "
        "(vLLM's names): deepseek_r1, qwen3, glm45 (<think>...</think>), mistral ([THINK]...[/THINK]), "
        "seed_oss, or none.",
        default_text="qwen3 when the chat template mentions <think>, else none",
    ),
    Flag(
        "--tool-call-parser",
        "model.tool_call_parser",
        "The model's own tool-call format, read back into `tool_calls` and followed by the tool grammar "
        "(vLLM's names): hermes (<tool_call>{...}</tool_call>), llama3_json, mistral ([TOOL_CALLS][...]), "
        "json (one JSON object a line), or none (same as json).",
        default_text="from the chat template: hermes, llama3_json or mistral when it writes that format, else json",
    ),
    Flag(
        "--quantize",
        "model.quantize",
        "Weight quantization: bitsandbytes, bitsandbytes-nf4, bitsandbytes-fp4, eetq or fp8 quantize while "
        "loading; gptq, awq and compressed-tensors checkpoints are recognised without it; gguf keeps a GGUF "
        "file's quantized tensors.",
        default_text="as the checkpoint is stored",
    ),
    Flag(
        "--served-model-name",
        "model.served_model_name",
        "The model's name in the API: /info's model_id, /v1/models, the `model` of OpenAI responses.",
        default_text="--model-id; a .gguf file's name without its folder",
    ),
    Flag(
        "--lora-adapters",
        "model.lora_adapters",
        "LoRA adapters served beside the base model (TGI's form): comma-separated `name=path` or a path "
        "or hub id (named as given), each a folder in PEFT's format (adapter_config.json + "
        "adapter_model.safetensors). Requests pick one by `adapter_id` or OpenAI's `model`.",
        default_text="none",
    ),
    Flag(
        "--max-lora-rank",
        "model.max_lora_rank",
        "The largest LoRA rank an adapter may have; a larger one is refused.",
        int,
    ),
    Flag(
        "--max-loras",
        "model.max_loras",
        "LoRA adapters resident at once (at start and loaded at run time); giving it turns adapters on "
        "even without --lora-adapters.",
        int,
        default_text="8, or as many as --lora-adapters names",
    ),
    Flag(
        "--rope-scaling",
        "model.rope_scaling",
        "RoPE scaling to serve longer contexts (TGI's): linear or dynamic (NTK-aware), by --rope-factor "
        "(1.0 when only this is given).",
        default_text="the model config's",
    ),
    Flag(
        "--rope-factor",
        "model.rope_factor",
        "RoPE scaling factor; alone, it scales linearly.",
        float,
        default_text="none",
    ),
    Flag(
        "--cuda-graphs",
        "model.cuda_graphs",
        "Decode batch sizes to capture as CUDA graphs (TGI's), comma-separated; 0 for none. Checked and "
        "planned (a batch pads to the next size); CUDA decode steps still run without graphs for now.",
    ),
    Flag(
        "--num-shard",
        "model.num_shard",
        "Tensor parallelism: run the model as N shards, one process each (shard 0 serves, the others "
        "follow its steps), every layer's heads, MLP and vocabulary split between them; gloo on CPU, NCCL "
        "on CUDA (one GPU per shard).",
        int,
        default_text="1; with --sharded true, every CUDA device",
    ),
    Flag(
        "--sharded",
        "model.sharded",
        "Whether to shard the model (true or false); true without --num-shard uses every CUDA device.",
        parse_bool_value,
        default_text="true when --num-shard > 1",
    ),
    Flag("--master-addr", "model.master_addr", "Address where the shards meet (shard 0 listens there)."),
    Flag("--master-port", "model.master_port", "Port where the shards meet (shard 0 listens there).", int),
)

ENGINE_FLAGS = (
    Flag(
        "--max-concurrent-requests",
        "limits.max_concurrent_requests",
        "Requests in flight at once (a best_of=n request counts n); more get RESOURCE_EXHAUSTED (REST 429).",
        int,
    ),
    Flag("--max-best-of", "limits.max_best_of", "Largest best_of a request may ask for.", int),
    Flag("--max-stop-sequences", "limits.max_stop_sequences", "Most stop sequences per request.", int),
    Flag("--max-top-n-tokens", "limits.max_top_n_tokens", "Largest top_n_tokens per request.", int),
    Flag(
        "--max-images-per-request",
        "limits.max_images_per_request",
        "Most images in one request (vision-language models); more get INVALID_ARGUMENT (TGI routes 422, OpenAI 400).",
        int,
    ),
    Flag(
        "--max-image-fetch-size",
        "limits.max_image_fetch_size",
        "Largest image in bytes, fetched from a URL or sent inline (TGI's flag).",
        int,
    ),
    Flag(
        "--max-input-tokens",
        "limits.max_input_tokens",
        "Longest prompt in tokens.",
        int,
        default_text="max-total-tokens - 1",
    ),
    Flag(
        "--max-input-length",
        "limits.max_input_tokens",
        "Legacy name of --max-input-tokens (give only one).",
        int,
        alias_of="--max-input-tokens",
        default_text="max-total-tokens - 1",
    ),
    Flag(
        "--max-total-tokens",
        "limits.max_total_tokens",
        "Longest prompt + generation in tokens.",
        int,
        default_text="as TGI: the model's context length (max_position_embeddings, max_seq_len, n_positions, ...) "
        "up to 4096, else 4096; at most what the KV cache holds",
    ),
    Flag(
        "--watermark-gamma",
        "limits.watermark_gamma",
        "Green-list fraction of the watermark (requests with watermark=true).",
        float,
    ),
    Flag("--watermark-delta", "limits.watermark_delta", "Logit bias added to green-list tokens.", float),
    Flag(
        "--disable-grammar-support",
        "limits.disable_grammar_support",
        "Refuse requests with a grammar (structured output) with a validation error.",
        parse_bool,
    ),
    Flag(
        "--grammar-compile-timeout-ms",
        "limits.grammar_compile_timeout_ms",
        "Longest a request's grammar may take to compile (its first token mask included); a grammar "
        "over it is refused at validation (422).",
        int,
    ),
    Flag(
        "--grammar-max-states",
        "limits.grammar_max_states",
        "Most lexer states one grammar may build (1-2 kB each); a grammar over it is refused at "
        "validation, or ends its request with an error if it gets there while generating.",
        int,
    ),
    Flag(
        "--max-batch-prefill-tokens",
        "scheduler.max_batch_prefill_tokens",
        "Budget of one engine step in tokens' work (prefill chunks + decodes): a prompt token deep in a "
        "long context counts more (its attention), and in a step that carries streams, prefill chunks that "
        "leave part of their prompt for later share 1/16 of it. Default 256 on CPU, 4096 on GPU.",
        int,
        default_text="by device",
    ),
    Flag(
        "--cuda-memory-fraction",
        "cache.cuda_memory_fraction",
        "Share of the CUDA device's memory the server may use; the KV cache gets what is left of it "
        "after the weights and a profiling forward pass of a full prefill. CUDA only.",
        float,
    ),
    Flag("--max-batch-size", "scheduler.max_batch_size", "Most requests in one step.", int, default_text="no cap"),
    Flag(
        "--waiting-served-ratio",
        "scheduler.waiting_served_ratio",
        "Accepted for TGI compatibility; with chunked prefill (always on) it has no effect.",
        float,
    ),
    Flag(
        "--max-waiting-tokens",
        "scheduler.max_waiting_tokens",
        "Accepted for TGI compatibility; with chunked prefill (always on) it has no effect.",
        int,
    ),
    Flag(
        "--speculate",
        "scheduler.speculate",
        "Speculative decoding: up to N tokens per request and step guessed by prompt lookup (n-grams of "
        "the request's own tokens) and verified in the same forward pass; outputs are unchanged.",
        int,
        default_text="0: off",
    ),
    Flag(
        "--max-batch-total-tokens",
        "cache.max_batch_total_tokens",
        "KV cache capacity in tokens; wins over --kv-cache-memory.",
        int,
        default_text="from --kv-cache-memory",
    ),
    Flag(
        "--kv-cache-memory",
        "cache.kv_cache_memory",
        "KV cache size: a fraction of free memory (0.3) or a size (512MiB, 2GiB).",
        default_text="0.1 on CPU; on CUDA what --cuda-memory-fraction leaves after a profiling forward pass",
    ),
    Flag(
        "--kv-cache-dtype",
        "cache.kv_cache_dtype",
        "What the KV cache stores: auto (the model's dtype), fp32, fp16 or bf16 (half fp32's bytes), or "
        "int8 (8-bit codes with a scale per token and KV head, 0.27x fp32's bytes). Smaller entries fit "
        "more tokens in the same --kv-cache-memory; decode attention reads them in place.",
    ),
    Flag("--block-size", "cache.block_size", "Tokens per KV cache block.", int),
    Flag(
        "--prefix-caching",
        "cache.prefix_caching",
        "Reuse the KV cache of a prompt's longest cached prefix (full blocks, freed ones kept until the "
        "pool needs them); --prefix-caching false turns it off.",
        parse_bool,
    ),
)

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

SERVE_FLAGS = MODEL_FLAGS + ENGINE_FLAGS + SERVER_FLAGS


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise CliError(message)


def _type_checked(flag: Flag) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return flag.type(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {_TYPE_NAMES.get(flag.type, 'a value')}, not {text!r}"
            ) from None

    convert.__name__ = _TYPE_NAMES.get(flag.type, "value")
    return convert


def add_flags(parser: argparse.ArgumentParser, flags: Sequence[Flag], title: str) -> None:
    group = parser.add_argument_group(title)
    for flag in flags:
        default = flag.default()
        shown = flag.default_text or (
            {False: "off", True: "on"}.get(default, default) if isinstance(default, bool) else default
        )
        help_text = f"{flag.help} (default: {shown}) [env: {flag.env}]"
        names = [flag.name] + ([flag.short] if flag.short else [])
        if flag.is_bool and default is True:  # on by default: `--flag false` turns it off
            group.add_argument(
                *names,
                dest=flag.dest,
                nargs="?",
                const=True,
                type=_type_checked(flag),
                default=None,
                metavar="true|false",
                help=help_text,
            )
        elif flag.is_bool:
            group.add_argument(*names, dest=flag.dest, action="store_const", const=True, default=None, help=help_text)
        else:
            group.add_argument(
                *names, dest=flag.dest, type=_type_checked(flag), default=None, metavar=flag.env, help=help_text
            )


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """The flags `serve` (and `launch`) share: model, engine limits, server."""
    add_flags(parser, MODEL_FLAGS, "model")
    add_flags(parser, ENGINE_FLAGS, "engine")
    add_flags(parser, SERVER_FLAGS, "server")


def resolve_flags(args: argparse.Namespace, flags: Sequence[Flag], environ: dict[str, str]) -> dict[str, Any]:
    """{flag name: value} of the flags set on the command line or in the environment."""
    values: dict[str, Any] = {}
    for flag in flags:
        value = getattr(args, flag.dest, None)
        if value is None and flag.env in environ:
            try:
                value = flag.type(environ[flag.env])
            except ValueError:
                raise CliError(
                    f"{flag.env}={environ[flag.env]!r}: expected {_TYPE_NAMES.get(flag.type, 'a value')}"
                ) from None
        if value is not None:
            values[flag.name] = value
    for flag in flags:
        if flag.alias_of and flag.name in values and flag.alias_of in values:
            raise CliError(
                f"{flag.alias_of} and {flag.name} are the same setting ({flag.name} is its "
                f"{'file' if flag.type is read_secret_file else 'legacy name'}): give only one"
            )
    return values


def build_configs(values: dict[str, Any], flags: Sequence[Flag]) -> dict[str, Any]:
    """{area: config dataclass} from resolved flag values; a bad value raises CliError."""
    fields: dict[str, dict[str, Any]] = {area: {} for area in AREAS}
    by_name = {flag.name: flag for flag in flags}
    for name, value in values.items():
        area, field_name = by_name[name].target.split(".")
        fields[area][field_name] = value
    try:
        return {area: cls(**fields[area]) for area, cls in AREAS.items()}
    except ValueError as error:
        raise CliError(str(error)) from None


def configs_from_args(
    args: argparse.Namespace, environ: dict[str, str] | None = None, flags: Sequence[Flag] = SERVE_FLAGS
) -> tuple[EngineConfig, ServerConfig]:
    environ = dict(os.environ) if environ is None else environ
    configs = build_configs(resolve_flags(args, flags, environ), flags)
    engine = EngineConfig(
        model=configs["model"], cache=configs["cache"], scheduler=configs["scheduler"], limits=configs["limits"]
    )
    return engine, configs["server"]


def warn_of_command_line_secrets(args: argparse.Namespace) -> None:
    """A key given as `--api-key` is in this process's command line, which every user sees (ps)."""
    if getattr(args, "api_key", None):
        logging.getLogger("inference_service").warning(
            "--api-key on the command line is visible to every user of this machine (ps): "
            "give it with --api-key-file or the API_KEY variable instead"
        )


def configure_logging(server: ServerConfig) -> None:
    """Logs go to stderr, as text or JSON lines (`--json-output`, then without progress bars)."""
    observability_logging.configure_logging(server.json_output, server.log_level)


def args_for(engine: EngineConfig, server: ServerConfig, flags: Sequence[Flag] = SERVE_FLAGS) -> list[str]:
    """The command line that gives back these configs (the settings that differ from the defaults),
    e.g. to start another process with the same settings. Legacy aliases are never written."""
    areas = {
        "model": engine.model,
        "cache": engine.cache,
        "scheduler": engine.scheduler,
        "limits": engine.limits,
        "server": server,
    }
    args: list[str] = []
    for flag in flags:
        if flag.alias_of:
            continue
        area, field_name = flag.target.split(".")
        value = getattr(areas[area], field_name)
        if value == flag.default():
            continue
        if flag.is_bool and flag.default() is not True:
            args.append(flag.name)  # a switch: present means on
        else:
            args += [flag.name, str(value).lower() if flag.is_bool else str(value)]
    return args
