"""What coincided with the hostile soak's slow innocent runs: the hostile cases in flight (kind,
transport), the server's own stall reports (its log's slow engine turns, late event loops and long
garbage collections) and the innocent clients' own garbage collections, for
tests/e2e/test_hostile.py's report.

Times are `time.monotonic()` seconds (one clock for every process on the machine); the server's log
lines carry wall-clock times, turned into the same clock by the soak's one pair of readings of both.
"""

from __future__ import annotations

import bisect
import gc
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass

SLOW_RATIO = 2.0  # the goal: an innocent run within 2x its idle median
STALL_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \w+ [\w.]+: "
    r"(?P<what>slow engine turn|long garbage collection|event loop late): (?P<ms>\d+) ms(?P<rest>.*)$"
)

STALL_NAMES = {"slow engine turn": "engine turn", "long garbage collection": "gc", "event loop late": "API event loop"}


@dataclass(frozen=True)
class Span:
    """Something that ran from `start` to `end`: a hostile case (`what` is kind and transport) or a
    server stall (`what` says which, `detail` its log fields)."""

    what: str
    start: float
    end: float
    detail: str = ""


class Overlaps:
    """Spans, found by the interval they overlap."""

    def __init__(self, spans: list[Span]):
        self.spans = sorted(spans, key=lambda span: span.start)
        self.starts = [span.start for span in self.spans]
        self.longest = max((span.end - span.start for span in self.spans), default=0.0)

    def over(self, start: float, end: float) -> list[Span]:
        low = bisect.bisect_left(self.starts, start - self.longest)
        high = bisect.bisect_left(self.starts, end)
        return [span for span in self.spans[low:high] if span.end > start]


class ClientCollections:
    """This process's garbage collections of at least `least_s`, as spans ("client gc"): the innocent
    requests' clients run here, and a full collection holds every one of their threads at once."""

    def __init__(self, least_s: float = 0.01):
        self.least_s = least_s
        self.spans: list[Span] = []
        self._started = 0.0

    def __enter__(self) -> ClientCollections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        now = time.monotonic()
        if phase == "start":
            self._started = now
        elif now - self._started >= self.least_s:
            self.spans.append(Span("client gc", self._started, now, f"generation={info['generation']}"))


def server_stalls(log_lines: list[str], monotonic_minus_wall: float) -> list[Span]:
    """The stall reports in the server's log (engine/slow_turns.py, engine/gc_pauses.py,
    api/loop_lag.py): each one's span ends when it was logged and lasted what it says."""
    stalls = []
    for line in log_lines:
        match = STALL_LINE.match(line)
        if match is None:
            continue
        wall = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")) + int(match.group(2)) / 1000
        end = wall + monotonic_minus_wall
        fields = " ".join(re.findall(r"\b\w+=\S+", match.group("rest")))
        what = STALL_NAMES[match.group("what")]
        stalls.append(Span(what, end - int(match.group("ms")) / 1000, end, fields))
    return stalls


def slowest_runs(
    runs: dict[str, list[tuple[float, float]]],
    idle_medians: dict[str, float],
    hostile: Overlaps,
    stalls: Overlaps,
    origin: float,
    server_s: dict[tuple[str, float], dict[str, float]] | None = None,
    count: int = 10,
) -> list[dict]:
    """The `count` innocent runs slowest against their idle median, when they started (seconds after
    `origin`), and what overlapped each: hostile cases by kind and transport, the server's stalls;
    and for a run the server gave its times for (`server_s`, by name and start: TGI's timing
    headers), those, and what lay outside them (Envoy, the connection, the client)."""
    spans = sorted(
        ((end - start) / idle_medians[name], name, start, end) for name, each in runs.items() for start, end in each
    )[::-1][:count]
    return [
        {
            "name": name,
            "start_s": round(start - origin, 3),
            "latency_s": round(end - start, 4),
            "ratio_to_idle": round(ratio, 2),
            "hostile_in_flight": dict(Counter(span.what for span in hostile.over(start, end)).most_common()),
            "stalls": [
                f"{span.what} {span.end - span.start:.3f} s at {span.start - origin:.3f} {span.detail}".strip()
                for span in stalls.over(start, end)
            ],
            **_server_split((server_s or {}).get((name, start)), end - start),
        }
        for ratio, name, start, end in spans
    ]


def _server_split(times: dict[str, float] | None, latency: float) -> dict:
    if times is None:
        return {}
    return {"server_s": times, "outside_server_s": round(latency - times["total"], 4)}


def kinds_beside_slow_runs(
    runs: dict[str, list[tuple[float, float]]], idle_medians: dict[str, float], hostile: Overlaps
) -> dict[str, dict]:
    """Per hostile kind and transport: its share of the overlaps with every innocent run, and its
    share of the overlaps with the runs slower than SLOW_RATIO x idle; a kind whose second share is
    well above its first coincides with slow runs more than its numbers explain."""
    every, slow = Counter(), Counter()
    for name, each in runs.items():
        for start, end in each:
            kinds = Counter(span.what for span in hostile.over(start, end))
            every.update(kinds)
            if (end - start) / idle_medians[name] > SLOW_RATIO:
                slow.update(kinds)
    total_every, total_slow = sum(every.values()) or 1, sum(slow.values()) or 1
    table = {
        what: {
            "overlaps": every[what],
            "beside_slow_runs": slow[what],
            "share_of_overlaps": round(every[what] / total_every, 3),
            "share_beside_slow_runs": round(slow[what] / total_slow, 3),
            # over 1: beside slow runs more often than its overlaps alone explain (a long-held idle
            # connection overlaps many runs and does nothing: its lift stays low)
            "lift": round((slow[what] / total_slow) / (every[what] / total_every), 2),
        }
        for what in every
    }
    return dict(sorted(table.items(), key=lambda item: -item[1]["lift"]))


def runs_beside_stalls(runs: dict[str, list[tuple[float, float]]], idle_medians: dict[str, float], stalls: Overlaps):
    """How many innocent runs over SLOW_RATIO x idle overlapped a server stall report, of how many."""
    slow = [
        (start, end)
        for name, each in runs.items()
        for start, end in each
        if (end - start) / idle_medians[name] > SLOW_RATIO
    ]
    return {"slow_runs": len(slow), "beside_a_stall": sum(bool(stalls.over(start, end)) for start, end in slow)}


def server_share_of_slow_runs(
    runs: dict[str, list[tuple[float, float]]],
    idle_medians: dict[str, float],
    server_s: dict[tuple[str, float], dict[str, float]],
) -> dict[str, dict[str, float]]:
    """For the runs over SLOW_RATIO x idle that the server gave its times for: where their latency went,
    as medians of each part's share (the engine queue, inference, the rest of the server's total, and
    outside the server), against the same for every such run: did the slow ones lose their time in
    the engine, or before and after it?"""

    def shares(spans: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
        parts = {"queue": [], "inference": [], "rest_of_server": [], "outside_server": []}
        for latency, times in spans:
            parts["queue"].append(times["queue"] / latency)
            parts["inference"].append(times["inference"] / latency)
            parts["rest_of_server"].append((times["total"] - times["queue"] - times["inference"]) / latency)
            parts["outside_server"].append((latency - times["total"]) / latency)
        return {"runs": len(spans), **{k: round(statistics.median(v), 3) for k, v in parts.items() if v}}

    timed = [
        (name, end - start, server_s[(name, start)])
        for name, each in runs.items()
        for start, end in each
        if (name, start) in server_s
    ]
    slow = [(latency, times) for name, latency, times in timed if latency / idle_medians[name] > SLOW_RATIO]
    return {"all": shares([(latency, times) for _, latency, times in timed]), "slow": shares(slow)}
