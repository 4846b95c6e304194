"""Reading REST answers as a client sees them: SSE events and `curl -i` output."""

from __future__ import annotations

import json


def sse_events(text: str) -> list[dict]:
    """The `data: ` events of an SSE body; TGI's framing is exactly `data: <json>\\n\\n`."""
    assert text.endswith("\n\n"), text[-200:]
    events = text.split("\n\n")[:-1]
    assert all(event.startswith("data: ") and "\n" not in event for event in events), text[:500]
    return [json.loads(event[len("data: ") :]) for event in events]


def status_and_body(raw: str) -> tuple[int, dict[str, str], str]:
    """(status, headers with lower-case names, body) of `curl -i` output."""
    head, _, body = raw.replace("\r\n", "\n").partition("\n\n")
    status_line, *header_lines = head.split("\n")
    pairs = (line.split(": ", 1) for line in header_lines if ": " in line)
    headers = {name.lower(): value for name, value in pairs}
    return int(status_line.split()[1]), headers, body
