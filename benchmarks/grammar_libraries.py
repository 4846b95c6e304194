"""Which grammar engine: llguidance vs xgrammar vs outlines-core on the demo model's tokenizer.

For each library and each grammar: the tokenizer setup, the compile time, the per-token mask time
over a seeded random walk (each step draws one allowed token, EOS as soon as it is allowed, at
most 200 tokens), and whether the walk's text parses and validates. The walk stands in for a
model: it reaches more of the grammar than greedy decoding of one model would.

Only llguidance is a project dependency. To rerun the comparison, install the others into the
venv first (xgrammar Requires-Dist triton on Linux, which is not needed to measure on CPU):

    .venv/bin/pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi
    .venv/bin/pip install outlines-core
    .venv/bin/python benchmarks/grammar_libraries.py
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import RESULTS_DIR  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 24},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["id", "tags", "address", "active"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
GRAMMARS = {"json:person": ("json", PERSON), "json:nested": ("json", NESTED), "regex": ("regex", REGEX)}
MAX_STEPS = 200
# One fixed whitespace style in every library (xgrammar's any_whitespace=False): flexible whitespace
# lets a walk, or a weak model, loop on blanks forever.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def check(kind: str, value, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(value, text) is not None
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), value)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def allowed_ids(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    bits = (bitmask.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()


def walk(rng: random.Random, eos_id: int, mask_fn, accept_fn, vocab_size: int) -> tuple[list[int], list[float]]:
    """Draw allowed tokens until EOS; returns the tokens (EOS excluded) and each step's mask time."""
    tokens, times = [], []
    for _ in range(MAX_STEPS):
        started = time.perf_counter()
        mask = mask_fn()
        times.append(time.perf_counter() - started)
        ids = allowed_ids(mask, vocab_size)
        token = eos_id if eos_id in ids else rng.choice(ids)
        if token == eos_id:
            break
        accept_fn(token)
        tokens.append(token)
    return tokens, times


def bench_llguidance(tokenizer, eos_id: int, vocab_size: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    started = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_id)
    setup = time.perf_counter() - started
    rows = {}
    for name, (kind, value) in GRAMMARS.items():
        started = time.perf_counter()
        grammar = (
            llguidance.LLMatcher.grammar_from_json_schema(value, defaults=COMPACT_JSON)
            if kind == "json"
            else llguidance.LLMatcher.grammar_from_regex(value)
        )
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        compile_s = time.perf_counter() - started
        assert not matcher.is_error(), matcher.get_error()
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

        def mask(matcher=matcher, bitmask=bitmask):
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            return bitmask[0]

        rows[name] = run_walks(
            kind,
            value,
            tokenizer,
            eos_id,
            vocab_size,
            compile_s,
            mask,
            matcher.consume_token,
            lambda m=matcher: m.reset(),
        )
    return {"setup_s": setup, "grammars": rows}


def bench_xgrammar(tokenizer, eos_id: int, vocab_size: int) -> dict:
    import xgrammar

    started = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos_id])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - started
    rows = {}
    for name, (kind, value) in GRAMMARS.items():
        started = time.perf_counter()
        compiled = (
            compiler.compile_json_schema(json.dumps(value), any_whitespace=False)
            if kind == "json"
            else compiler.compile_regex(value)
        )
        matcher = xgrammar.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - started
        bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

        def mask(matcher=matcher, bitmask=bitmask):
            matcher.fill_next_token_bitmask(bitmask, 0)
            return bitmask[0]

        rows[name] = run_walks(
            kind, value, tokenizer, eos_id, vocab_size, compile_s, mask, matcher.accept_token, matcher.reset
        )
    return {"setup_s": setup, "grammars": rows}


def bench_outlines_core(tokenizer, eos_id: int, vocab_size: int) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    started = time.perf_counter()
    vocab: dict[str, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id != eos_id and token_id not in tokenizer.all_special_ids:
            vocab.setdefault(token, []).append(token_id)
    vocabulary = Vocabulary(eos_id, vocab)
    setup = time.perf_counter() - started
    rows = {}
    for name, (kind, value) in GRAMMARS.items():
        started = time.perf_counter()
        regex = build_regex_from_schema(json.dumps(value)) if kind == "json" else value
        guide = Guide(Index(regex, vocabulary))
        compile_s = time.perf_counter() - started
        width = (vocab_size + 31) // 32
        state = {"guide": guide}

        def mask(state=state, width=width):
            ids = torch.tensor(state["guide"].get_tokens(), dtype=torch.int64)
            bits = torch.zeros(width * 32, dtype=torch.int64)
            bits[ids] = 1
            packed = (bits.view(width, 32) << torch.arange(32)).sum(-1)
            return packed.to(torch.int64).remainder(2**32).to(torch.int32)  # bit pattern as int32

        def accept(token, state=state):
            state["guide"].advance(token)

        def reset(state=state, regex=regex):
            state["guide"] = Guide(Index(regex, vocabulary))

        rows[name] = run_walks(kind, value, tokenizer, eos_id, vocab_size, compile_s, mask, accept, reset)
    return {"setup_s": setup, "grammars": rows}


def run_walks(kind, value, tokenizer, eos_id, vocab_size, compile_s, mask, accept, reset, num_walks: int = 5) -> dict:
    times, valid = [], 0
    for seed in range(num_walks):
        reset()
        tokens, step_times = walk(random.Random(seed), eos_id, mask, accept, vocab_size)
        times += step_times
        valid += check(kind, value, tokenizer.decode(tokens))
    return {
        "compile_ms": 1000 * compile_s,
        "mask_us_median": 1e6 * statistics.median(times),
        "mask_us_p90": 1e6 * sorted(times)[int(0.9 * len(times))],
        "num_masks": len(times),
        "valid": f"{valid}/{num_walks}",
    }


LIBRARIES = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines-core": bench_outlines_core}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", help="a transformers folder (default: the demo model)")
    parser.add_argument("--libraries", nargs="+", default=list(LIBRARIES))
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    from inference_service.models.demo import ensure_demo_model
    from inference_service.models.loader import load_tokenizer

    tokenizer = load_tokenizer(str(args.model_dir or ensure_demo_model()))
    vocab_size, eos_id = len(tokenizer), tokenizer.eos_token_id
    torch.set_num_threads(1)
    results = {}
    for library in args.libraries:
        print(f"measuring {library} ...", file=sys.stderr, flush=True)
        try:
            results[library] = LIBRARIES[library](tokenizer, eos_id, vocab_size)
        except ImportError as error:
            print(f"  skipped: {error}", file=sys.stderr)
    lines = [
        "| library | tokenizer setup ms | grammar | compile ms | mask µs p50 | mask µs p90 | valid |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for library, result in results.items():
        for name, row in result["grammars"].items():
            lines.append(
                f"| {library} | {1000 * result['setup_s']:.0f} | {name} | {row['compile_ms']:.1f} | "
                f"{row['mask_us_median']:.0f} | {row['mask_us_p90']:.0f} | {row['valid']} |"
            )
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grammar_libraries.md").write_text(table + "\n")
    (args.out / "grammar_libraries.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
