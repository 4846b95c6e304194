"""Logs on stderr: text lines, or JSON lines with `--json-output`.

A record may carry structured fields (`extra={"fields": {...}}`): text lines append them as
`key=value`, JSON lines merge them into the object, so the per-request line is as easy to grep as
to query. Prompts and generated text are never logged.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from typing import Any

from inference_service import progress

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message key=value ...`."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _fields(record)
        if not fields:
            return line
        head, newline, rest = line.partition("\n")  # keep a traceback below the fields
        pairs = " ".join(f"{key}={_text_value(value)}" for key, value in fields.items())
        return f"{head} {pairs}{newline}{rest}"


def _text_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if (" " in text or not text) else text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: timestamp, level, target (the logger), message, then the fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "timestamp": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        for key, value in _fields(record).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


# Rejections while the server can't take requests (loading, draining), by the reason's text.
UNAVAILABLE_CHANNEL = "unavailable"
_last_states: dict[str, str] = {}
_states_lock = threading.Lock()


def level_for_state(channel: str, state: str, level: int) -> int:
    """`level` when `state` differs from the last one seen on `channel`, else DEBUG: a health poll
    every second, or Envoy retrying a request, while the model loads says "still loading" once, not
    once per call; draining later is a new state, said once too."""
    with _states_lock:
        changed = _last_states.get(channel) != state
        _last_states[channel] = state
    return level if changed else logging.DEBUG


def log_state(logger: logging.Logger, channel: str, state: str, level: int, message: str, *args: Any) -> None:
    """Log a line about a state at `level` once per state (`level_for_state`)."""
    logger.log(level_for_state(channel, state, level), message, *args)


def configure_logging(json_output: bool, log_level: str) -> None:
    """Logs go to stderr, as text or JSON lines (`--json-output`, then without progress bars)."""
    progress.configure(json_output)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_output else TextFormatter())
    logging.basicConfig(level=log_level.upper(), handlers=[handler], force=True)
