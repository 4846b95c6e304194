"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SYSTEM_STYLE = {"engine": ("tab:blue", "o", "engine"), "hf": ("tab:orange", "s", "transformers generate")}
PROTOCOL_STYLE = {"grpc": ("tab:blue", "o", "gRPC"), "rest": ("tab:green", "s", "REST via Envoy")}
PERCENTILE_STYLE = {"p50": "-", "p90": "--", "p99": ":"}


def engine_latency_throughput(results: list[dict], path: Path, title: str) -> None:
    """TGI's benchmark view: latency against throughput, one point per batch size, prefill and decode."""
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for axis, phase, latency_key, tps_key, floor_key in (
        (axes[0], "prefill", "prefill_ms", "prefill_tok_s", "prefill_ms"),
        (axes[1], "decode", "decode_token_ms", "decode_tok_s", "decode_ms"),
    ):
        for system, (color, marker, label) in SYSTEM_STYLE.items():
            xs = [row[system][tps_key] for row in results]
            ys = [row[system][latency_key]["p50"] for row in results]
            axis.plot(xs, ys, marker=marker, color=color, label=label)
            for row, x, y in zip(results, xs, ys, strict=True):
                axis.annotate(
                    f"b{row['batch_size']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8, color=color
                )
        tokens = [row["batch_size"] * (row["prompt_tokens"] if phase == "prefill" else 1) for row in results]
        floor_x = [n / (row["floor"][floor_key] / 1000) for n, row in zip(tokens, results, strict=True)]
        axis.plot(
            floor_x,
            [row["floor"][floor_key] for row in results],
            linestyle="--",
            color="gray",
            marker=".",
            label="bare-matmul floor",
        )
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel(f"{phase} throughput (tokens/s)")
        axis.set_ylabel("p50 latency (ms" + (" per step)" if phase == "decode" else ")"))
        axis.set_title(f"{phase}: latency vs throughput per batch size")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def serve_overview(levels: list[dict], path: Path, title: str) -> None:
    """Closed-loop levels: throughput, TTFT and ITL percentiles vs concurrency, and ITL vs throughput."""
    closed = [level for level in levels if level["mode"] == "closed"]
    figure, axes = plt.subplots(2, 2, figsize=(12, 9))
    (throughput, ttft), (itl, tradeoff) = axes
    concurrencies = sorted({level["concurrency"] for level in closed})
    for protocol, (color, marker, label) in PROTOCOL_STYLE.items():
        rows = sorted((lv for lv in closed if lv["protocol"] == protocol), key=lambda lv: lv["concurrency"])
        if not rows:
            continue
        xs = [row["concurrency"] for row in rows]
        throughput.plot(
            xs, [row["token_throughput"] for row in rows], marker=marker, color=color, label=f"{label} tokens/s"
        )
        for q, style in PERCENTILE_STYLE.items():
            ttft.plot(
                xs,
                [row["ttft_ms"][q] for row in rows],
                marker=marker,
                color=color,
                linestyle=style,
                label=f"{label} {q}",
            )
            itl.plot(
                xs,
                [row["itl_ms"][q] for row in rows],
                marker=marker,
                color=color,
                linestyle=style,
                label=f"{label} {q}",
            )
        tradeoff.plot(
            [row["token_throughput"] for row in rows],
            [row["itl_ms"]["p50"] for row in rows],
            marker=marker,
            color=color,
            label=label,
        )
        for row in rows:
            tradeoff.annotate(
                f"c{row['concurrency']}",
                (row["token_throughput"], row["itl_ms"]["p50"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
                color=color,
            )
    for axis, ylabel, name in (
        (throughput, "generated tokens/s", "throughput"),
        (ttft, "time to first token (ms)", "TTFT"),
        (itl, "inter-token latency (ms)", "inter-token latency"),
    ):
        axis.set_xscale("log", base=2)
        axis.set_xticks(concurrencies, [str(c) for c in concurrencies])
        axis.set_xlabel("concurrent requests (closed loop)")
        axis.set_ylabel(ylabel)
        axis.set_title(f"{name} vs concurrency")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    ttft.set_yscale("log")
    tradeoff.set_xlabel("generated tokens/s")
    tradeoff.set_ylabel("p50 inter-token latency (ms)")
    tradeoff.set_title("latency vs throughput per concurrency")
    tradeoff.grid(True, alpha=0.3)
    tradeoff.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def lines_against(series: dict[str, tuple[list[float], list[float]]], path: Path, title: str, xlabel: str, ylabel: str):
    """One line per named series (xs, ys), both axes logarithmic (base 2 for x)."""
    figure, axis = plt.subplots(figsize=(8, 5))
    for name, (xs, ys) in series.items():
        axis.plot(xs, ys, marker="o", label=name)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
