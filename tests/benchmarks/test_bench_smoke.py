"""Smoke tests of the benchmark scripts: each runs in quick mode and writes its table, plot and data.
No timing is asserted: these prove the scripts work, the numbers are for the full runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_engine_bench_quick(tmp_path, tiny_model_dir):
    run_script(
        "engine_bench.py",
        "--quick",
        "--model-id",
        str(tiny_model_dir),
        "--batch-sizes",
        "1",
        "2",
        "--out",
        str(tmp_path),
    )
    table = (tmp_path / "engine.md").read_text()
    assert "#### Prefill" in table and "#### Decode" in table and "![" in table
    rows = [line for line in table.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 4  # batch sizes 1 and 2, prefill and decode
    assert (tmp_path / "engine.png").read_bytes().startswith(b"\x89PNG")
    results = json.loads((tmp_path / "engine.json").read_text())["results"]
    assert [r["batch_size"] for r in results] == [1, 2]
    for row in results:
        for system in ("engine", "hf"):
            assert row[system]["decode_token_ms"]["n"] == 2 * (8 - 1)  # 2 runs of 7 decode steps
            assert row[system]["prefill_tok_s"] > 0 and row[system]["decode_tok_s"] > 0
        assert row["floor"]["decode_ms"] > 0


def test_grammar_bench_quick(tmp_path, tiny_model_dir):
    run_script("grammar_bench.py", "--quick", "--model-id", str(tiny_model_dir), "--out", str(tmp_path))
    assert "JSON schema ms/step" in (tmp_path / "grammar.md").read_text()
    results = json.loads((tmp_path / "grammar.json").read_text())["results"]
    assert [r["batch_size"] for r in results] == [1, 2]
    for row in results:
        for name in ("free", "json"):
            assert row[name]["step_ms"]["n"] == 8 - 1  # one run of 7 decode steps, both ways
            assert row[name]["sample_ms"]["n"] == 8 - 1


def test_prefix_cache_bench_quick(tmp_path, tiny_model_dir):
    # A short system prompt: the tiny model's byte tokenizer spends many tokens on the questions.
    run_script(
        "prefix_cache_bench.py",
        "--quick",
        "--model-id",
        str(tiny_model_dir),
        "--system-tokens",
        "60",
        "--out",
        str(tmp_path),
    )
    assert "Follow-up TTFT, off ÷ on" in (tmp_path / "prefix_cache.md").read_text()
    data = json.loads((tmp_path / "prefix_cache.json").read_text())
    summary = data["summary"]
    assert summary["identical_replies"]
    for name in ("off", "on"):
        assert summary[name]["ttft_follow_up_ms"]["n"] == 3 * 2  # 3 conversations, 2 follow-up turns
        assert summary[name]["ttft_first_turn_ms"]["n"] == 3
        assert summary[name]["generated_tok_s"] > 0
    off, on = summary["off"], summary["on"]
    assert off["num_prefill_tokens_computed"] == off["num_prompt_tokens"] and off["hit_rate"] == 0
    assert on["num_prefill_tokens_computed"] < off["num_prefill_tokens_computed"] and on["hit_rate"] > 0
    assert [len(data["runs"][name]) for name in ("off", "on")] == [1, 1]


def test_speculation_bench_quick(tmp_path, tiny_model_dir):
    run_script("speculation_bench.py", "--quick", "--model-id", str(tiny_model_dir), "--out", str(tmp_path))
    assert "--speculate 4 tok/s" in (tmp_path / "speculation.md").read_text()
    data = json.loads((tmp_path / "speculation.json").read_text())
    for workload in ("editing", "free"):
        summary = data["summary"][workload]
        assert summary["identical"] and summary["speedup"] > 0
        assert summary["plain"]["tokens"] == summary["speculative"]["tokens"] > 0
        assert 0 < summary["plain"]["tokens_per_step"] <= 1 and 0 <= summary["acceptance_rate"] <= 1  # chunks: < 1
    assert len(data["requests"]) == 2 + 2  # two prompts per workload, one run


@pytest.mark.e2e
def test_serve_bench_quick(tmp_path, tiny_model_dir):
    run_script("serve_bench.py", "--quick", "--model-id", str(tiny_model_dir), "--out", str(tmp_path))
    assert (tmp_path / "serve.png").read_bytes().startswith(b"\x89PNG")
    assert "TTFT p50 ms" in (tmp_path / "serve.md").read_text()
    levels = json.loads((tmp_path / "serve.json").read_text())["levels"]
    modes = {(level["protocol"], level["mode"]) for level in levels}
    assert modes == {(p, m) for p in ("grpc", "rest") for m in ("closed", "open", "burst")}
    for level in levels:
        assert level["num_other_errors"] == 0, level["other_errors"]
        if level["mode"] == "closed":  # below the limit: every request succeeds
            assert level["num_ok"] == level["num_requests"] > 0
    burst = [level for level in levels if level["mode"] == "burst"]
    assert all(level["num_ok"] + level["num_overloaded"] == level["num_requests"] for level in burst)
    assert (tmp_path / "serve-server.log").exists()


def test_tiny_model_builds_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.tiny_model import ensure_tiny_model

    folder = ensure_tiny_model(tmp_path / "tiny")
    assert ensure_tiny_model(folder) == folder  # built once
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.decode(tokenizer.encode("the café 😀")) == "the café 😀"


def test_quant_kernels_quick(tmp_path):
    run_script("quant_kernels.py", "--quick", "--out", str(tmp_path))
    assert "4-bit gs=32 ms" in (tmp_path / "quant_kernels.md").read_text()
    results = json.loads((tmp_path / "quant_kernels.json").read_text())["results"]
    assert [r["rows"] for r in results] == [1, 4, 32] * 2
    assert all(ms > 0 for r in results for ms in r["ms"].values())


def test_quant_bench_quick(tmp_path, tiny_model_dir):
    run_script(
        "quant_bench.py", "--quick", "--model-id", str(tiny_model_dir), "--schemes", "eetq", "--out", str(tmp_path)
    )
    assert "greedy = fp32" in (tmp_path / "quant.md").read_text()
    results = json.loads((tmp_path / "quant.json").read_text())["results"]
    assert [r["scheme"] for r in results] == ["fp32", "eetq"]
    for row in results:
        assert row["ppl"] > 1 and row["throughput_tok_s"] > 0 and row["decode_ms"]["n"] == 8 - 1
        assert row["weights_mib"] > 0 and all(len(tokens) == 8 for tokens in row["greedy"])
    assert results[1]["weights_mib"] < results[0]["weights_mib"]


def test_fallback_bench_quick(tmp_path):
    run_script("fallback_bench.py", "--quick", "--out", str(tmp_path))
    assert "engine ÷ transformers" in (tmp_path / "fallback.md").read_text()
    rows = json.loads((tmp_path / "fallback.json").read_text())["families"]
    assert [(row["family"], row["encoder_decoder"]) for row in rows] == [("bloom", False), ("t5", True)]
    for row in rows:
        assert row["engine_tok_s"] > 0 and row["transformers_tok_s"] > 0
        assert row["ratio"] == pytest.approx(row["engine_tok_s"] / row["transformers_tok_s"])


def test_bystander_latency_quick(tmp_path, tiny_model_dir):
    result = run_script("bystander_latency.py", "--quick", "--model-id", str(tiny_model_dir), "--out", str(tmp_path))
    assert "beside ÷ alone" in result.stdout
    data = json.loads((tmp_path / "bystander_latency.json").read_text())
    for policy in ("tokens", "work", "clock"):  # every step-budget policy, measured in the same run
        times = data[policy]
        assert len(times["alone_s"]) == len(times["beside_s"]) == len(times["stream_beside_s"]) == 1
        assert min(times["alone_s"] + times["beside_s"] + times["long_alone_s"]) > 0


def test_grammar_neighbours_quick(tiny_model_dir):
    result = run_script("grammar_neighbours.py", "--quick", "--model-id", str(tiny_model_dir))
    rows = [line.split("|")[1].strip() for line in result.stdout.splitlines() if line.startswith("| ")]
    assert rows == ["bystander", "alone", "niceness 0", "niceness 10"], result.stdout  # the baseline in the same run


def test_tensor_parallel_bench_quick(tmp_path, tiny_model_dir):
    run_script("tensor_parallel_bench.py", "--quick", "--model-id", str(tiny_model_dir), "--out", str(tmp_path))
    assert "Tensor parallel: --num-shard 2 vs 1" in (tmp_path / "tensor_parallel.md").read_text()
    assert "fallback runner" in (tmp_path / "tensor_parallel.md").read_text()
    results = json.loads((tmp_path / "tensor_parallel.json").read_text())
    for summary in (results["summary"], results["fallback"]):
        for workload in ("single", "batch"):
            assert summary[workload]["identical"]
            assert summary[workload]["decode_ms_per_step_ratio"] > 0


def test_step_overhead_counts_a_decode_step(tmp_path, tiny_model_dir):
    counts = tmp_path / "counts.json"
    run_script(
        "step_overhead.py",
        *("--model-id", str(tiny_model_dir), "--batch-size", "2", "--steps", "2", "--warmup-steps", "1"),
        *("--json", str(counts)),
    )
    result = json.loads(counts.read_text())
    assert result["batch_size"] == 2 and result["steps"] == 2
    steps = [calls for where, calls in result["per_function"].items() if re.search(r"llm_engine.py:\d+\(step\)", where)]
    assert steps == [1.0]  # per step, so the engine's own step() once
    assert result["python_calls"] > 100 and result["torch_calls"] > 0 and result["aten_ops"] > 0
    assert sum(result["per_aten_op"].values()) == result["aten_ops"]
    assert any(name.startswith("aten.") and "float32[" in name for name in result["per_aten_op_operands"])
    diff = run_script("step_overhead.py", "--diff", str(counts), str(counts)).stdout
    assert "python_calls: " in diff and "(+0.0 per step)" in diff and "per_function: 0 changed" in diff


def test_compare_commits_exports_a_commit_and_sets_ratios_side_by_side(tmp_path):
    from benchmarks import compare_commits

    sha = compare_commits.export("HEAD", tmp_path / "trees")
    assert (tmp_path / "trees" / sha[:12] / "benchmarks" / "compare_commits.py").is_file()

    def engine_run(folder: Path, decode: float) -> Path:
        folder.mkdir(parents=True)
        row = {"batch_size": 8, "engine": {"decode_tok_s": decode, "prefill_tok_s": 600.0}}
        row["hf"] = {"decode_tok_s": 100.0, "prefill_tok_s": 600.0}
        (folder / "engine.json").write_text(json.dumps({"results": [row]}))
        return folder

    runs = {
        "before": [engine_run(tmp_path / "b1", 320.0), engine_run(tmp_path / "b2", 300.0)],
        "after": [engine_run(tmp_path / "a1", 300.0), engine_run(tmp_path / "a2", 294.0)],
    }
    table, summary = compare_commits.summarize("engine", runs, {"before": "old", "after": "new"})
    decode = summary["batch 8 decode ÷ transformers"]
    assert decode["before"] == [3.2, 3.0] and decode["after"] == [3.0, 2.94]
    assert decode["after_over_before"] == pytest.approx(2.97 / 3.1)
    assert "| batch 8 decode ÷ transformers | 3.10 (3.20 / 3.00) | 2.97 (3.00 / 2.94) | 0.958 |" in table
    assert summary["batch 8 prefill ÷ transformers"]["after_over_before"] == 1.0
    assert summary["batch 8 decode tok/s, engine alone"]["after_over_before"] == pytest.approx(297.0 / 310.0)


def test_vision_bench_quick(tmp_path):
    run_script("vision_bench.py", "--quick", "--out", str(tmp_path))
    table = (tmp_path / "vision.md").read_text()
    assert "engine ÷ transformers" in table and "Follow-up turn" in table
    results = json.loads((tmp_path / "vision.json").read_text())
    assert results["params"]["requests"] == 4
    assert list(results["workloads"]) == ["chat", "burst", "prefill-heavy"]
    for kind in ("text", "random"):  # the cached image is not encoded again
        assert results["follow_up"][kind]["medians"]["second_encoded_images"] == 0
    # a reply that tokenizes back to its ids: the whole first turn is reused (a 4-token reply: all
    # of the prompt and 3 reply tokens; the 4th was sampled, never run)
    text = results["follow_up"]["text"]["conversations"][0]
    assert text["second_hit_tokens"] == text["first_prompt_tokens"] + 3


def test_vision_bench_quick_on_another_family(tmp_path):
    run_script("vision_bench.py", "--quick", "--family", "paligemma", "--out", str(tmp_path))
    assert "Model: a random paligemma." in (tmp_path / "vision_paligemma.md").read_text()
    assert json.loads((tmp_path / "vision_paligemma.json").read_text())["family"] == "paligemma"


def test_decode_speed_bench_quick(tmp_path, tiny_model_dir):
    schemes = ("--schemes", "fp32", "bf16")
    run_script("decode_speed_bench.py", "--quick", "--model-id", str(tiny_model_dir), *schemes, "--out", str(tmp_path))
    assert "growth from short" in (tmp_path / "decode_speed.md").read_text()
    runs = json.loads((tmp_path / "decode_speed.json").read_text())["runs"]
    assert [run["n"] for run in runs["fp32"]["32"]] == [run["n"] for run in runs["bf16"]["32"]] == [8 - 1]


def test_decode_phases_times_each_phase_of_both_dtypes(tiny_model_dir):
    result = run_script("decode_phases.py", "--model-id", str(tiny_model_dir), "--tokens", "4", "--rounds", "1")
    rows = {line.split("|")[1].strip(): line for line in result.stdout.splitlines() if line.startswith("| ")}
    assert {"layers in one call", "qkv", "head", "attention", "step"} <= rows.keys()
    assert rows["step"].rstrip().endswith("× |"), "no bf16 ÷ fp32 ratio for the whole step"
