"""Reading REST answers as a client sees them: SSE events, `curl -i` output, streams through curl."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


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


def start_stream(url: str, body: dict) -> tuple[subprocess.Popen, bytes]:
    """curl a stream (`url` is the route's whole URL); returns it and its first line, once that has arrived."""
    curl = subprocess.Popen(
        ["curl", "-sS", "-N", "--max-time", "60", url, "-H", "Content-Type: application/json", "-d", json.dumps(body)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    first = curl.stdout.readline()
    assert first.startswith(b"data: {"), first
    return curl, first


def finish_stream(curl: subprocess.Popen, first: bytes) -> subprocess.CompletedProcess:
    """The rest of a `start_stream`: (curl's exit status, the whole body, curl's stderr)."""
    output = first + curl.stdout.read()
    curl.wait(60)
    return subprocess.CompletedProcess(curl.args, curl.returncode, output.decode(), curl.stderr.read().decode())


def openai_chunks(body: str) -> list[dict]:
    """The JSON chunks of an OpenAI SSE body, which must end with `data: [DONE]`."""
    lines = [line for line in body.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]", lines[-2:]
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def engine_core_of(server_pid: int) -> int:
    """The pid of a server's engine-core process (its one child)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])
