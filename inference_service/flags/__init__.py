"""The server's flags: TGI's launcher names, their environment variables, and the config dataclasses
they fill. Shared by the `inference-service` commands (cli.py) and the gateway's `launch`, which sit
above this module and import it; it imports neither.

Each flag can also come from the SCREAMING_SNAKE_CASE environment variable of the same name
(`--max-total-tokens` ⇄ `MAX_TOTAL_TOKENS`); a flag wins over its variable, and either wins over the
config dataclass default.

The flags themselves are tabled by group (model_flags, engine_flags, server_flags) over `flag.Flag`;
this module reads a command line and the environment into the config dataclasses, and back.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from inference_service.api.config import ServerConfig
from inference_service.config import EngineConfig
from inference_service.flags.engine_flags import ENGINE_FLAGS
from inference_service.flags.flag import (
    AREAS,
    TYPE_NAMES,
    CliError,
    CommandFailed,
    Flag,
    NamedFlag,
    parse_bool,
    parse_bool_value,
    read_secret_file,
)
from inference_service.flags.model_flags import MODEL_FLAGS
from inference_service.flags.server_flags import SERVER_FLAGS
from inference_service.observability import logging as observability_logging

__all__ = [
    "AREAS",
    "ENGINE_FLAGS",
    "MODEL_FLAGS",
    "SERVER_FLAGS",
    "SERVE_FLAGS",
    "CliError",
    "CommandFailed",
    "Flag",
    "NamedFlag",
    "Parser",
    "add_config_flags",
    "add_flags",
    "args_for",
    "build_configs",
    "configs_from_args",
    "configure_logging",
    "parse_bool",
    "parse_bool_value",
    "read_secret_file",
    "resolve_flags",
    "warn_of_command_line_secrets",
]

SERVE_FLAGS = MODEL_FLAGS + ENGINE_FLAGS + SERVER_FLAGS


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise CliError(message)


def _type_checked(flag: Flag) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return flag.type(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {TYPE_NAMES.get(flag.type, 'a value')}, not {text!r}") from None

    convert.__name__ = TYPE_NAMES.get(flag.type, "value")
    return convert


def add_flags(parser: argparse.ArgumentParser, flags: Sequence[Flag], title: str) -> None:
    group = parser.add_argument_group(title)
    for flag in flags:
        default = flag.default()
        shown = flag.default_text or (
            {False: "off", True: "on"}.get(default, default) if isinstance(default, bool) else default
        )
        help_text = f"{flag.help} (default: {shown}) [env: {flag.env}]"
        names = [flag.name] + ([flag.short] if flag.short else [])
        if flag.is_bool and default is True:  # on by default: `--flag false` turns it off
            group.add_argument(
                *names,
                dest=flag.dest,
                nargs="?",
                const=True,
                type=_type_checked(flag),
                default=None,
                metavar="true|false",
                help=help_text,
            )
        elif flag.is_bool:
            group.add_argument(*names, dest=flag.dest, action="store_const", const=True, default=None, help=help_text)
        else:
            group.add_argument(
                *names, dest=flag.dest, type=_type_checked(flag), default=None, metavar=flag.env, help=help_text
            )


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """The flags `serve` (and `launch`) share: model, engine limits, server."""
    add_flags(parser, MODEL_FLAGS, "model")
    add_flags(parser, ENGINE_FLAGS, "engine")
    add_flags(parser, SERVER_FLAGS, "server")


def resolve_flags(args: argparse.Namespace, flags: Sequence[Flag], environ: dict[str, str]) -> dict[str, Any]:
    """{flag name: value} of the flags set on the command line or in the environment."""
    values: dict[str, Any] = {}
    for flag in flags:
        value = getattr(args, flag.dest, None)
        if value is None and flag.env in environ:
            try:
                value = flag.type(environ[flag.env])
            except ValueError:
                raise CliError(
                    f"{flag.env}={environ[flag.env]!r}: expected {TYPE_NAMES.get(flag.type, 'a value')}"
                ) from None
        if value is not None:
            values[flag.name] = value
    for flag in flags:
        if flag.alias_of and flag.name in values and flag.alias_of in values:
            raise CliError(
                f"{flag.alias_of} and {flag.name} are the same setting ({flag.name} is its "
                f"{'file' if flag.type is read_secret_file else 'legacy name'}): give only one"
            )
    return values


def build_configs(values: dict[str, Any], flags: Sequence[Flag]) -> dict[str, Any]:
    """{area: config dataclass} from resolved flag values; a bad value raises CliError."""
    fields: dict[str, dict[str, Any]] = {area: {} for area in AREAS}
    by_name = {flag.name: flag for flag in flags}
    for name, value in values.items():
        area, field_name = by_name[name].target.split(".")
        fields[area][field_name] = value
    try:
        return {area: cls(**fields[area]) for area, cls in AREAS.items()}
    except ValueError as error:
        raise CliError(str(error)) from None


def configs_from_args(
    args: argparse.Namespace, environ: dict[str, str] | None = None, flags: Sequence[Flag] = SERVE_FLAGS
) -> tuple[EngineConfig, ServerConfig]:
    environ = dict(os.environ) if environ is None else environ
    configs = build_configs(resolve_flags(args, flags, environ), flags)
    engine = EngineConfig(
        model=configs["model"], cache=configs["cache"], scheduler=configs["scheduler"], limits=configs["limits"]
    )
    return engine, configs["server"]


def warn_of_command_line_secrets(args: argparse.Namespace) -> None:
    """A key given as `--api-key` is in this process's command line, which every user sees (ps)."""
    if getattr(args, "api_key", None):
        logging.getLogger("inference_service").warning(
            "--api-key on the command line is visible to every user of this machine (ps): "
            "give it with --api-key-file or the API_KEY variable instead"
        )


def configure_logging(server: ServerConfig) -> None:
    """Logs go to stderr, as text or JSON lines (`--json-output`, then without progress bars)."""
    observability_logging.configure_logging(server.json_output, server.log_level)


def args_for(engine: EngineConfig, server: ServerConfig, flags: Sequence[Flag] = SERVE_FLAGS) -> list[str]:
    """The command line that gives back these configs (the settings that differ from the defaults),
    e.g. to start another process with the same settings. Legacy aliases are never written."""
    areas = {
        "model": engine.model,
        "cache": engine.cache,
        "scheduler": engine.scheduler,
        "limits": engine.limits,
        "server": server,
    }
    args: list[str] = []
    for flag in flags:
        if flag.alias_of:
            continue
        area, field_name = flag.target.split(".")
        value = getattr(areas[area], field_name)
        if value == flag.default():
            continue
        if flag.is_bool and flag.default() is not True:
            args.append(flag.name)  # a switch: present means on
        else:
            args += [flag.name, str(value).lower() if flag.is_bool else str(value)]
    return args
