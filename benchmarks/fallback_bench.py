"""The fallback runner against transformers' `generate` in static batches, on the same tiny random
models, in the same run: decoder-only families the paged attention can't serve (BLOOM, Falcon,
GPT-J, MPT) and encoder-decoders (T5, BART, M2M100).

Workload: mixed prompt and output lengths submitted at once (EOS ignored), as in
`engine_vs_transformers.py`; the engine batches continuously, transformers pads each static batch
and runs it until its longest request is done. Decode rows batch on this path when their caches
hold as many tokens: encoder-decoders admitted together always do (their decoders grow alike),
decoder-only requests only when their prompts happen to be as long. Reported per family: generated
tokens per second of each and their ratio; the goal (≥ 2×) is the encoder-decoders'.

Usage: python benchmarks/fallback_bench.py [--quick] [--family t5 ...] [--requests N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM  # noqa: E402

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
    "t5": {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4},
    "bart": {
        "d_model": 64,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 128,
        "decoder_ffn_dim": 128,
        "max_position_embeddings": 1024,
    },
    "m2m_100": {
        "d_model": 64,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 128,
        "decoder_ffn_dim": 128,
        "max_position_embeddings": 1024,
    },
}
GOAL = 2.0  # engine ÷ transformers, for the encoder-decoders


def make_model(family: str, folder: Path) -> Path:
    """A seeded random model of `family` with the benchmarks' tiny tokenizer (EOS also pads and,
    for encoder-decoders, starts the decoder)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model.ensure_tiny_model())
    eos = tokenizer.eos_token_id
    config = AutoConfig.for_model(
        family, vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=eos, pad_token_id=eos, **FAMILIES[family]
    )
    if config.is_encoder_decoder:
        config.decoder_start_token_id = eos
        config.forced_eos_token_id = None  # BART's default would end every output on EOS
    auto_class = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    torch.manual_seed(0)
    auto_class.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def measure(family: str, num_requests: int, output_range: tuple[int, int], batch_size: int) -> dict:
    """Generated tokens/s of the engine and of transformers' static batches on one family."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = make_model(family, Path(scratch))
        engine = build_engine(
            EngineConfig(
                model=ModelConfig(model_id=str(folder)),
                cache=CacheConfig(max_batch_total_tokens=16384),
                limits=LimitsConfig(max_total_tokens=512),
            )
        )
        warm_up(engine)
        auto_class = AutoModelForSeq2SeqLM if engine.info.is_encoder_decoder else AutoModelForCausalLM
        reference = auto_class.from_pretrained(folder, dtype=torch.float32).eval()
        workload = common.make_workload(num_requests, (8, 64), output_range, engine.info.vocab_size, seed=0)
        ours = run_engine(engine, workload, f"{family}: engine")
        theirs = run_transformers_static(
            reference, workload, batch_size, engine.info.eos_token_ids[0], f"{family}: transformers"
        )
    engine_tok_s, transformers_tok_s = workload.num_generated / ours["wall"], workload.num_generated / theirs["wall"]
    return {
        "family": family,
        "encoder_decoder": engine.info.is_encoder_decoder,
        "engine_tok_s": engine_tok_s,
        "transformers_tok_s": transformers_tok_s,
        "ratio": engine_tok_s / transformers_tok_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 6 short requests, bloom and t5")
    parser.add_argument("--family", nargs="+", choices=sorted(FAMILIES))
    parser.add_argument("--requests", type=int)
    parser.add_argument("--batch-size", type=int, default=8, help="transformers' static batch size")
    parser.add_argument("--out", help="output folder (default: benchmarks/results, quick: results/raw/quick)")
    args = parser.parse_args(argv)
    num_requests = args.requests or (6 if args.quick else 32)
    families = args.family or (["bloom", "t5"] if args.quick else ["bloom", "falcon", "t5", "bart", "m2m_100"])
    out = common.output_dir(args.out, args.quick)
    output_range = (4, 8) if args.quick else (16, 96)
    rows = [measure(family, num_requests, output_range, args.batch_size) for family in families]
    table = [
        [
            row["family"],
            "encoder-decoder" if row["encoder_decoder"] else "decoder-only",
            common.fmt(row["engine_tok_s"]),
            common.fmt(row["transformers_tok_s"]),
            f"**{row['ratio']:.2f}×**",
            (("met" if row["ratio"] >= GOAL else "not met") + f" (≥ {GOAL:g}×)") if row["encoder_decoder"] else "–",
        ]
        for row in rows
    ]
    markdown = (
        "#### Fallback runner: decoder-only families and encoder-decoders (tiny random models)\n\n"
        f"{num_requests} requests, prompts 8–64 tokens, {output_range[0]}–{output_range[1]} new tokens "
        f"(EOS ignored), submitted at once; transformers in static batches of {args.batch_size}.\n\n"
        + common.markdown_table(
            ["family", "kind", "engine tok/s", "transformers tok/s", "engine ÷ transformers", "goal"], table
        )
        + f"\n\n{common.machine_line(common.machine())}\n\n`{common.command_line()}`\n"
    )
    (out / "fallback.md").write_text(markdown)
    common.write_json(out / "fallback.json", {"args": vars(args), "machine": common.machine(), "families": rows})
    print("\n" + markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
