"""The engine's flags: request limits, watermarking, grammars, scheduler and speculation, KV cache."""

from __future__ import annotations

from inference_service.flags.flag import Flag, parse_bool

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
        "Longest a request's grammar may take to compile (its first token mask included; CPU time, and "
        "its caller waits no longer); a grammar over it is refused at validation (422).",
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
        "Reuse the KV cache of a prompt's longest cached prefix (to the token: full blocks, then part of a "
        "chain's last block; freed ones kept until the pool needs them); --prefix-caching false turns it off.",
        parse_bool,
    ),
)
