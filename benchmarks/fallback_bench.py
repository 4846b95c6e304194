"""The fallback runner (models the paged attention can't serve: BLOOM, Falcon, GPT-J, MPT) against
transformers' `generate` in static batches, on the same tiny random model, in the same run.

Workload: mixed prompt and output lengths submitted at once (EOS ignored), as in
`engine_vs_transformers.py`; the engine batches continuously (one forward per request on this
path), transformers pads each static batch and runs it until its longest request is done.
Reported: generated tokens per second of each and their ratio. No goal is set for the fallback
(the issue's ≥ 2× is for the seq2seq path, not built yet); this is the baseline to improve on.

Usage: python benchmarks/fallback_bench.py [--quick] [--family bloom] [--requests N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from benchmarks import common, tiny_model  # noqa: E402
from benchmarks.engine_vs_transformers import run_engine, run_transformers_static  # noqa: E402
from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig  # noqa: E402
from inference_service.engine.builder import build_engine, warm_up  # noqa: E402

# Tiny configs, 2 layers of width 64 (as the tests' tiny models).
FAMILIES = {
    "bloom": {"hidden_size": 64, "n_layer": 2, "n_head": 4},
    "falcon": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_kv_heads": 4},
    "gptj": {"n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8, "n_inner": 128, "n_positions": 1024},
    "mpt": {"d_model": 64, "n_heads": 4, "n_layers": 2, "expansion_ratio": 2, "max_seq_len": 1024},
}


def make_model(family: str, folder: Path) -> Path:
    """A seeded random model of `family` with the benchmarks' tiny tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model.ensure_tiny_model())
    config = AutoConfig.for_model(family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                  bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                                  **FAMILIES[family])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 6 short requests")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="bloom")
    parser.add_argument("--requests", type=int)
    parser.add_argument("--batch-size", type=int, default=8, help="transformers' static batch size")
    parser.add_argument("--out", help="output folder (default: benchmarks/results, quick: results/raw/quick)")
    args = parser.parse_args(argv)
    num_requests = args.requests or (6 if args.quick else 32)
    out = common.output_dir(args.out, args.quick)
    with tempfile.TemporaryDirectory() as scratch:
        folder = make_model(args.family, Path(scratch))
        engine = build_engine(EngineConfig(model=ModelConfig(model_id=str(folder)),
                                           cache=CacheConfig(max_batch_total_tokens=16384),
                                           limits=LimitsConfig(max_total_tokens=512)))
        warm_up(engine)
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        output_range = (4, 8) if args.quick else (16, 96)
        workload = common.make_workload(num_requests, (8, 64), output_range, engine.info.vocab_size, seed=0)
        ours = run_engine(engine, workload, "fallback engine")
        theirs = run_transformers_static(reference, workload, args.batch_size, engine.info.eos_token_ids[0],
                                         "transformers static")
    ours_tok_s, theirs_tok_s = workload.num_generated / ours["wall"], workload.num_generated / theirs["wall"]
    markdown = (f"#### Fallback runner ({args.family}, tiny random model, {engine.info.attention_impl} attention)\n\n"
                f"{num_requests} requests, prompts 8–64 tokens, {output_range[0]}–{output_range[1]} new tokens "
                f"(EOS ignored), submitted at once; transformers in static batches of {args.batch_size}.\n\n"
                + common.markdown_table(["", "generated tok/s", "wall s"], [
                    ["fallback engine", common.fmt(ours_tok_s), common.fmt(ours["wall"], 2)],
                    ["transformers static batches", common.fmt(theirs_tok_s), common.fmt(theirs["wall"], 2)]])
                + f"\n\n**Engine ÷ transformers: {ours_tok_s / theirs_tok_s:.2f}×.**\n\n"
                f"{common.machine_line(common.machine())}\n\n`{common.command_line()}`\n")
    (out / "fallback.md").write_text(markdown)
    common.write_json(out / "fallback.json", {"args": vars(args), "machine": common.machine(),
                                              "engine_tok_s": ours_tok_s, "transformers_tok_s": theirs_tok_s,
                                              "ratio": ours_tok_s / theirs_tok_s})
    print("\n" + markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
