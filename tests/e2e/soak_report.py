"""The hostile soak's report: the innocent runs' latency statistics (medians, p95s, ratios to the idle
median and to idle quantile by quantile),
the count of answers meaning a server fault, the one line a rerun is quoted by, and the markdown
written to benchmarks/results/hostile_soak.md (what overlapped the slow runs comes from
tests/e2e/soak_attribution.py).
"""

from __future__ import annotations

import statistics
from collections import Counter

from tests.e2e.hostile_cases import SERVER_FAULT_CODES
from tests.e2e.hostile_sending import SOAK_PARTS, SOAK_WORKERS
from tests.e2e.soak_attribution import SLOW_RATIO


def quantile(values: list[float], q: float) -> float:
    return sorted(values)[int(q * (len(values) - 1))]


def p95(values: list[float]) -> float:
    return quantile(values, 0.95)


def summary(latencies: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        name: {
            "runs": len(values),
            "median_s": round(statistics.median(values), 4),
            "p95_s": round(p95(values), 4),
            "max_s": round(max(values), 4),
        }
        for name, values in latencies.items()
    }


def latency_ratios(loaded: dict[str, list[float]], idle: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Each innocent run's latency beside the hostile requests ÷ that request's idle median: the
    median, p95 and max of those ratios (the issue's goal: within 2× idle)."""
    ratios = {}
    for name, values in loaded.items():
        base = statistics.median(idle[name])
        each = [value / base for value in values]
        ratios[name] = {
            "median": round(statistics.median(each), 2),
            "p95": round(p95(each), 2),
            "max": round(max(each), 2),
        }
    return ratios


def quantile_ratios(loaded: dict[str, list[float]], idle: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Each innocent request's latency beside the hostile requests against its idle latency quantile by
    quantile (p50 ÷ p50, p99 ÷ p99, ...): on a shared machine idle latency is a spread, not one number
    (its own slowest runs are 1.5-1.9x its median), so a run at the loaded p99 is compared with the idle
    p99. The max is compared at the idle runs' count: the slowest of as many loaded runs as there are
    idle ones (the median over disjoint draws), since the slowest of thousands exceeds the slowest of
    hundreds even where the two spreads are the same."""
    ratios = {}
    for name, values in loaded.items():
        base, count = idle[name], len(idle[name])
        draws = [max(values[start : start + count]) for start in range(0, len(values) - count + 1, count)]
        row = {q: round(quantile(values, level) / quantile(base, level), 2) for q, level in QUANTILES.items()}
        row["max_of_idle_count"] = round(statistics.median(draws or [max(values)]) / max(base), 2)
        row["idle_runs"], row["loaded_runs"] = count, len(values)
        ratios[name] = row
    return ratios


QUANTILES = {"p50": 0.5, "p90": 0.9, "p95": 0.95, "p99": 0.99}


def server_errors(statuses: Counter) -> int:
    """Answers meaning the server failed (an HTTP 5xx, a gRPC status reserved for server faults):
    overload is documented as a 429 (RESOURCE_EXHAUSTED over gRPC), so none is expected."""
    count = 0
    for key, number in statuses.items():
        status = key.rsplit(" ", 1)[1]
        if status in SERVER_FAULT_CODES or (status.isdigit() and int(status) >= 500):
            count += number
    return count


def summary_line(results: dict) -> str:
    """One line a rerun can be quoted by."""
    worst, floor = results["latency_ratio_to_idle"], results["idle_latency_ratio_to_idle"]
    return (
        f"hostile soak: {results['cases']} cases in {results['seconds']} s, "
        f"{results['server_errors']} 5xx/server-fault answers, {results['wrong_answers']} wrong answers, "
        f"{results['bystander_failures']} bystander failures in {results['bystander_runs']} runs, "
        f"bystander latency ÷ idle median: median {max(r['median'] for r in worst.values())}, "
        f"p95 {max(r['p95'] for r in worst.values())}, max {max(r['max'] for r in worst.values())} "
        f"(idle runs themselves: p95 {max(r['p95'] for r in floor.values())}, "
        f"max {max(r['max'] for r in floor.values())}); quantile by quantile against idle: "
        + ", ".join(
            f"{q} {max(r[q] for r in results['latency_quantile_ratio'].values())}"
            for q in (*QUANTILES, "max_of_idle_count")
        )
        + "; "
        f"KV blocks free before {results['kv_blocks_free_before']}, after {results['kv_blocks_free_after']}; "
        f"RSS MiB before→after: "
        + ", ".join(
            f"{name} {points[0]}→{points[-1]}"
            for name, points in results["rss_mib_after_warmup_then_each_part"].items()
        )
    )


def markdown(results: dict) -> str:
    lines = [
        "# Hostile-input soak",
        "",
        "`pytest -m soak -s tests/e2e/test_hostile.py`: hostile requests of every kind in tests/e2e/hostile_cases.py",
        f"({SOAK_WORKERS} at a time, from worker processes) beside three innocent request loops (a greedy chat",
        "stream and a /generate through Envoy, a gRPC stream to the engine), on the tiny model.",
        "",
        summary_line(results),
        "",
        "Innocent latency: idle is the three loops beside each other alone, in a window before each part of",
        "the cases (the same machine, the same moment); each run that overlapped hostile requests is divided",
        "by its request's idle median.",
        "",
        "| innocent request | idle median (s) | beside hostile median (s) | p95 (s) | max (s) "
        "| ÷ idle: median | p95 | max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, ratio in results["latency_ratio_to_idle"].items():
        idle, loaded = results["bystander_latency_idle"][name], results["bystander_latency_beside_hostile"][name]
        lines.append(
            f"| {name} | {idle['median_s']} | {loaded['median_s']} | {loaded['p95_s']} | {loaded['max_s']} "
            f"| {ratio['median']} | {ratio['p95']} | {ratio['max']} |"
        )
    lines += [
        "",
        "Quantile by quantile: each innocent request's loaded latency at p50, p90, p95 and p99 ÷ its idle",
        "latency at the same quantile; the max as the slowest of as many loaded runs as there are idle runs",
        "(the median over disjoint draws in time order) ÷ the slowest idle run.",
        "",
        "| innocent request | idle runs | loaded runs | p50 | p90 | p95 | p99 | max at the idle count |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results["latency_quantile_ratio"].items():
        lines.append(
            f"| {name} | {row['idle_runs']} | {row['loaded_runs']} | {row['p50']} | {row['p90']} | {row['p95']} "
            f"| {row['p99']} | {row['max_of_idle_count']} |"
        )
    memory = results["rss_mib_after_warmup_then_each_part"]
    lines += ["", f"RSS (MiB) once warm, then after each of {SOAK_PARTS} parts of the cases: " + str(memory)]
    cpu = results["cpu_seconds_during_soak"]
    lines += ["", "CPU seconds used during the soak (idle windows included): " + str(cpu)]
    lines += ["", "The server's by process/thread: " + str(results["server_cpu_seconds_by_thread"])]
    lines += ["", *attribution_markdown(results), ""]
    lines += ["Answers (kind, transport, status): " + ", ".join(f"{k}: {v}" for k, v in results["answers"].items())]
    return "\n".join(lines) + "\n"


def attribution_markdown(results: dict) -> list[str]:
    """What ran beside the slowest innocent runs, and which hostile kinds coincide with slow runs."""
    stalls = results["slow_runs_beside_a_stall"]
    lines = [
        "## What the slowest innocent runs beside hostile cases overlapped",
        "",
        "Stalls: the server's reports in its log (engine turns that held every stream, late API event loops, "
        "long garbage collections) and the innocent clients' own garbage collections (client gc) over 10 ms: "
        f"{results['stalls']}; innocent runs over {SLOW_RATIO}x idle: {stalls['slow_runs']}, "
        f"of which {stalls['beside_a_stall']} overlapped a stall report.",
        "",
        "Where the /generate runs' latency went (median shares, from TGI's timing headers), all loaded runs "
        f"against those over {SLOW_RATIO}x idle: {results['where_slow_runs_went']}",
        "",
        "The server's own account (TGI's timing headers, /generate only): its total, the engine queue and "
        "inference within it, and what lay outside the server (Envoy, the connection, the client).",
        "",
        "| innocent run | start (s) | latency (s) | ÷ idle | server: total / queue / inference (s) | outside (s) "
        "| hostile cases in flight | stalls |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in results["slowest_bystander_runs"]:
        hostile = ", ".join(f"{what} ×{count}" for what, count in run["hostile_in_flight"].items()) or "none"
        times = run.get("server_s")
        server = f"{times['total']} / {times['queue']} / {times['inference']}" if times else "–"
        lines.append(
            f"| {run['name']} | {run['start_s']} | {run['latency_s']} | {run['ratio_to_idle']} | {server} "
            f"| {run.get('outside_server_s', '–')} | {hostile} | {'; '.join(run['stalls']) or 'none'} |"
        )
    lines += [
        "",
        f"Hostile kinds (and transport) by their share of all overlaps with innocent runs and of the overlaps "
        f"with runs over {SLOW_RATIO}x idle; lift, the second ÷ the first (a kind well over 1 is a suspect):",
        "",
        "| hostile kind | overlaps | beside slow runs | share of overlaps | share beside slow runs | lift |",
        "|---|---|---|---|---|---|",
    ]
    for what, row in results["hostile_kinds_beside_slow_runs"].items():
        lines.append(
            f"| {what} | {row['overlaps']} | {row['beside_slow_runs']} | {row['share_of_overlaps']} "
            f"| {row['share_beside_slow_runs']} | {row['lift']} |"
        )
    return lines
