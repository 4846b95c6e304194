"""LoRA adapters for tests, made here with `peft` in its on-disk format, and `peft`'s greedy
generation as the reference the server's rows must equal."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: float = 16,
    targets: list[str] | None = None,
    use_rslora: bool = False,
    scale: float = 0.3,
) -> Path:
    """A random LoRA adapter of the model in `base_dir` (non-zero A and B: it changes the outputs),
    saved by peft into `out_dir`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        use_rslora=use_rslora,
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    model.save_pretrained(out_dir)
    return out_dir


def peft_model(base_dir: Path, adapter_dir: Path | None):
    """transformers' model of `base_dir` with the adapter applied by peft (None: the base alone)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir).eval()


def greedy_reference(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy token ids and their raw logprobs, one full forward per token (no cache)."""
    ids = list(prompt_ids)
    tokens, logprobs = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only contend on a busy machine
    try:
        return _greedy(model, ids, max_new_tokens, tokens, logprobs)
    finally:
        torch.set_num_threads(threads)


def _greedy(model, ids: list[int], max_new_tokens: int, tokens: list[int], logprobs: list[float]):
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, dim=-1)
            token = int(torch.argmax(logits))
            tokens.append(token)
            logprobs.append(float(lp[token]))
            ids.append(token)
    return tokens, logprobs
