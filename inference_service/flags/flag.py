"""What a flag is: its name, the config field it sets, its environment variable and how its text
is read; the errors a command line can raise."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference_service.api.config import ServerConfig
from inference_service.config import CacheConfig, LimitsConfig, ModelConfig, SchedulerConfig

# Which dataclass each flag group fills.
AREAS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "limits": LimitsConfig,
    "server": ServerConfig,
}


class CliError(Exception):
    """A user mistake in flags or variables; the message is the whole story."""


class CommandFailed(Exception):
    """The command could not do its job (port taken, ...); the message says why."""


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, not {text!r}")


def read_secret_file(path: str) -> str:
    """A secret kept in a file (`--api-key-file`): its text, without the line end an editor adds."""
    try:
        return Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError):
        raise ValueError(f"cannot read {path!r}") from None


def parse_bool_value(text: str) -> bool:
    """A flag that takes `true` or `false` as its value (TGI's `--sharded <true|false>`), unlike a switch."""
    return parse_bool(text)


TYPE_NAMES = {
    parse_bool_value: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    parse_bool: "true or false",
    read_secret_file: "a readable file",
}


class NamedFlag:
    """A flag's environment variable and argparse dest, both derived from its name (TGI's rule)."""

    name: str

    @property
    def env(self) -> str:
        return self.name.lstrip("-").replace("-", "_").upper()

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Flag(NamedFlag):
    """One command-line flag, the config field it sets, and its environment variable."""

    name: str  # "--max-total-tokens"
    target: str  # "limits.max_total_tokens"
    help: str
    type: Callable[[str], Any] = str
    short: str | None = None
    alias_of: str | None = None  # another flag setting the same field: a legacy name, a file (both given = error)
    default_text: str | None = None  # what an unset default (None) means, for --help

    @property
    def is_bool(self) -> bool:
        return self.type is parse_bool

    def default(self) -> Any:
        area, field_name = self.target.split(".")
        fields = {f.name: f for f in dataclasses.fields(AREAS[area])}
        field = fields[field_name]
        return field.default if field.default is not dataclasses.MISSING else field.default_factory()
