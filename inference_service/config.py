"""Configuration: one frozen dataclass per area, validated on construction.

Values that are only known once the model is loaded (KV blocks, auto limits, EOS ids) are not
written back here: they live in `outputs.EngineInfo`.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

DEMO_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# TGI's --quantize values and ours (gguf); worker/weights/schemes.py says what each one does.
QUANTIZE_SCHEMES = (
    "bitsandbytes",
    "bitsandbytes-nf4",
    "bitsandbytes-fp4",
    "eetq",
    "fp8",
    "gptq",
    "awq",
    "compressed-tensors",
    "gguf",
)
# vLLM's --reasoning-parser and --tool-call-parser names we know (frontend/reasoning.py and
# frontend/tool_parsers.py implement them); unset, the chat template decides.
REASONING_PARSERS = ("deepseek_r1", "qwen3", "glm45", "mistral", "seed_oss", "none")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "json", "none")
ROPE_SCALINGS = ("linear", "dynamic")  # TGI's --rope-scaling values


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how."""

    model_id: str = DEMO_MODEL_ID
    revision: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    trust_remote_code: bool = False
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    huggingface_hub_cache: str | None = None
    chat_template: str | None = None  # a Jinja file replacing the tokenizer's chat template
    quantize: str | None = None  # a scheme of worker/weights/schemes.py; None: as the checkpoint is stored
    # The name the API gives the model (/info, /v1/models, responses); None: loader.served_name's default.
    served_model_name: str | None = None
    reasoning_parser: str | None = None  # a name of REASONING_PARSERS; None: from the chat template
    tool_call_parser: str | None = None  # a name of TOOL_CALL_PARSERS; None: from the chat template
    # LoRA adapters served beside the base (TGI's --lora-adapters: comma-separated `name=path` or a
    # path / hub id); None: none at start. Adapters are on when this or max_loras is given.
    lora_adapters: str | None = None
    max_lora_rank: int = 64  # the largest rank an adapter may have
    max_loras: int | None = None  # adapters resident at once; None: 8 (at least those of lora_adapters)

    @property
    def lora_enabled(self) -> bool:
        return bool(self.lora_adapters and self.lora_adapters.strip()) or self.max_loras is not None

    # TGI's RoPE scaling (models/rope.py): linear | dynamic, and its factor; None for both: the config's.
    rope_scaling: str | None = None
    rope_factor: float | None = None
    # Decode batch sizes for CUDA graphs (TGI's list; "0": none); worker/runner/cuda_graphs.py plans them.
    cuda_graphs: str = "1,2,4,8,16,32"
    # Tensor parallelism (TGI's flags): shards, each a process holding a slice of every layer.
    # None: 1, or with `sharded` every CUDA device.
    num_shard: int | None = None
    sharded: bool | None = None  # None: sharded when num_shard > 1
    master_addr: str = "localhost"  # where the shards meet (shard 0 listens)
    master_port: int = 29500

    def __post_init__(self) -> None:
        _require(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            f"--dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}",
        )
        _require(
            self.device == "auto" or re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
            f"--device must be auto, cpu, cuda or cuda:N, not {self.device!r}",
        )
        _require(self.num_threads is None or self.num_threads > 0, "--num-threads must be > 0")
        _require(
            self.served_model_name is None or self.served_model_name.strip() != "",
            "--served-model-name must not be empty",
        )
        _require(
            self.quantize is None or self.quantize in QUANTIZE_SCHEMES,
            f"--quantize must be one of {', '.join(QUANTIZE_SCHEMES)}, not {self.quantize!r}",
        )
        _require(
            self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
            f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, not {self.reasoning_parser!r}",
        )
        _require(
            self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSERS,
            f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, not {self.tool_call_parser!r}",
        )
        _require(self.max_lora_rank >= 1, "--max-lora-rank must be >= 1")
        _require(self.max_loras is None or self.max_loras >= 1, "--max-loras must be >= 1")
        _require(
            self.rope_scaling is None or self.rope_scaling in ROPE_SCALINGS,
            f"--rope-scaling must be linear or dynamic, not {self.rope_scaling!r}",
        )
        _require(
            self.rope_factor is None or (math.isfinite(self.rope_factor) and self.rope_factor > 0),
            f"--rope-factor must be a number > 0, not {self.rope_factor!r}",
        )
        parse_cuda_graphs(self.cuda_graphs)
        _require(self.num_shard is None or self.num_shard >= 1, "--num-shard must be >= 1")
        _require(
            not (self.sharded is False and (self.num_shard or 1) > 1),
            f"--sharded false contradicts --num-shard {self.num_shard}",
        )
        _require(
            not (self.sharded and self.num_shard == 1), "--sharded true needs --num-shard > 1 (or unset: every GPU)"
        )
        _require(0 < self.master_port < 65536, "--master-port must be a port number (1-65535)")
        _require(self.master_addr.strip() != "", "--master-addr must not be empty")


# --kv-cache-dtype values: the model's dtype, fp32, half the bytes (fp16, bf16), or int8 codes with a
# scale per token and KV head (a little over a quarter of fp32's bytes).
KV_CACHE_DTYPES = ("auto", "fp32", "float32", "fp16", "float16", "bf16", "bfloat16", "int8")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, how many blocks the pool holds, and prefix caching."""

    block_size: int = 16
    # An explicit capacity in tokens wins over the memory budget.
    max_batch_total_tokens: int | None = None
    # A fraction of free device memory ("0.3") or a size ("512MiB", "2GiB"); None = the device default.
    kv_cache_memory: str | None = None
    # Reuse the KV blocks of a cached prompt prefix (engine/prefix_cache.py); TGI's PREFIX_CACHING.
    prefix_caching: bool = True
    # What the cache stores (worker/attention/kv_cache.py); "auto": the model's dtype. TGI's --kv-cache-dtype.
    kv_cache_dtype: str = "auto"
    # Share of a CUDA device's memory the server may use (weights, activations, KV cache); TGI's flag.
    cuda_memory_fraction: float = 1.0

    def __post_init__(self) -> None:
        _require(self.block_size > 0, "block size must be > 0")
        _require(
            not self.kv_cache_dtype.startswith("fp8"),
            f"--kv-cache-dtype {self.kv_cache_dtype} is TGI's CUDA format; this server's 8-bit KV cache is int8",
        )
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}",
        )
        _require(
            self.max_batch_total_tokens is None or self.max_batch_total_tokens > 0,
            "--max-batch-total-tokens must be > 0",
        )
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)
        _require(
            0.0 < self.cuda_memory_fraction <= 1.0,
            f"--cuda-memory-fraction must be in (0, 1], not {self.cuda_memory_fraction}",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits per step."""

    max_batch_prefill_tokens: int | None = None  # token budget of one step; None = device default
    max_batch_size: int | None = None  # requests in one step; None = bounded by the budget only
    # Accepted for TGI compatibility. With chunked prefill (always on here) TGI ignores both:
    # new requests join the running batch at every step without pausing it.
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20
    # Draft tokens guessed per request and step by prompt lookup, verified in the same forward pass
    # (engine/speculation.py); 0: off. TGI's --speculate.
    speculate: int = 0

    def __post_init__(self) -> None:
        _require(
            self.max_batch_prefill_tokens is None or self.max_batch_prefill_tokens > 0,
            "--max-batch-prefill-tokens must be > 0",
        )
        _require(self.max_batch_size is None or self.max_batch_size > 0, "--max-batch-size must be > 0")
        _require(self.waiting_served_ratio >= 0, "--waiting-served-ratio must be >= 0")
        _require(self.max_waiting_tokens >= 0, "--max-waiting-tokens must be >= 0")
        _require(0 <= self.speculate <= 16, f"--speculate must be between 0 and 16, not {self.speculate}")


@dataclass(frozen=True)
class LimitsConfig:
    """Per-request limits, with TGI's launcher defaults."""

    max_input_tokens: int | None = None  # None = max_total_tokens - 1
    max_total_tokens: int | None = None  # None = TGI's default (models/context.py) within the KV capacity
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_best_of: int = 2
    max_concurrent_requests: int = 128
    watermark_gamma: float = 0.5
    watermark_delta: float = 2.0
    disable_grammar_support: bool = False  # True: every request with a grammar is refused
    # A grammar's budget at validation (compile + first mask): over it, the request is refused (422).
    grammar_compile_timeout_ms: int = 2000
    grammar_max_states: int = 50_000  # lexer DFA states of one grammar (1-2 kB each)
    # Vision-language models: images per request, and bytes of one image fetched or sent (TGI's default).
    max_images_per_request: int = 8
    max_image_fetch_size: int = 1_073_741_824

    def __post_init__(self) -> None:
        _require(self.max_input_tokens is None or self.max_input_tokens > 0, "--max-input-tokens must be > 0")
        _require(self.max_total_tokens is None or self.max_total_tokens > 1, "--max-total-tokens must be > 1")
        if self.max_input_tokens is not None and self.max_total_tokens is not None:
            _require(self.max_input_tokens < self.max_total_tokens, "`max_input_tokens` must be < `max_total_tokens`")
        _require(self.max_stop_sequences >= 0, "--max-stop-sequences must be >= 0")
        _require(self.max_top_n_tokens >= 0, "--max-top-n-tokens must be >= 0")
        _require(self.max_best_of >= 1, "--max-best-of must be >= 1")
        _require(self.max_concurrent_requests >= 1, "--max-concurrent-requests must be >= 1")
        _require(0.0 < self.watermark_gamma < 1.0, "--watermark-gamma must be in (0, 1)")
        _require(self.grammar_compile_timeout_ms > 0, "--grammar-compile-timeout-ms must be > 0")
        _require(self.grammar_max_states > 0, "--grammar-max-states must be > 0")
        _require(self.max_images_per_request >= 0, "--max-images-per-request must be >= 0")
        _require(self.max_image_fetch_size > 0, "--max-image-fetch-size must be > 0")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; the API and gateway have their own configs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(text: str) -> tuple[float | None, int | None]:
    """Parse `--kv-cache-memory`: returns (fraction, None) for "0.3" or (None, bytes) for "2GiB"."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"--kv-cache-memory must be a fraction like 0.3 or a size like 2GiB, not {text!r}")
    value, unit = float(match.group(1)), match.group(2).lower()
    if unit == "" and value <= 1.0:
        if value <= 0:
            raise ValueError("--kv-cache-memory must be > 0")
        return value, None
    return None, int(value * _UNITS[unit])


def parse_cuda_graphs(text: str) -> tuple[int, ...]:
    """`--cuda-graphs`: batch sizes to capture, comma-separated, sorted and deduplicated; "0": none."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = [-1]
    if sizes == [0]:
        return ()
    if not sizes or any(size < 1 for size in sizes):
        raise ValueError(f"--cuda-graphs must be batch sizes like 1,2,4,8 (or 0 for none), not {text!r}")
    return tuple(sorted(set(sizes)))


def default_cache_dir() -> str:
    """Where converted weights (the demo model, GGUF files) are cached."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "inference-service")
