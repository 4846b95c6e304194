"""The model's flags: what to load and how (source, dtype, device, threads, quantization, templates
and parsers, LoRA adapters, RoPE scaling, CUDA graphs, shards)."""

from __future__ import annotations

from inference_service.flags.flag import Flag, parse_bool, parse_bool_value

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
        "Decode batch sizes to capture as CUDA graphs (TGI's), comma-separated; 0 for none. On one CUDA "
        "device, decode-only steps pad to the next size and replay a graph captured the first time that "
        "size runs; the memory the graphs hold is kept out of the KV cache budget.",
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
