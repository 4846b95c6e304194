"""`inference-service`: serve the gRPC API, or prefetch a model's weights.

Flags have TGI's launcher names and environment variables (`inference_service.flags`). A mistake
ends the command with one line on stderr and a non-zero exit, never a traceback.

Commands are entries of `COMMANDS`; `launch` is the gateway's (`gateway.launch`), which reads the
flags it shares with `serve` from `inference_service.flags` too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from inference_service import __version__
from inference_service.api.stopping import run_until_stopped
from inference_service.config import DEMO_MODEL_ID
from inference_service.errors import ModelLoadError
from inference_service.flags import (
    MODEL_FLAGS,
    CliError,
    CommandFailed,
    Flag,
    Parser,
    add_config_flags,
    add_flags,
    build_configs,
    configs_from_args,
    configure_logging,
    parse_bool,
    resolve_flags,
    warn_of_command_line_secrets,
)

PROG = "inference-service"
EXIT_USAGE = 2  # bad flags or values (argparse's code)
EXIT_FAILURE = 1  # the model could not be loaded, or the server failed


# -- commands -----------------------------------------------------------------------------------
def _configure_serve(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser)


def _run_serve(args: argparse.Namespace) -> int:
    engine_config, server_config = configs_from_args(args)
    configure_logging(server_config)
    warn_of_command_line_secrets(args)
    return run_until_stopped(lambda: _serve(engine_config, server_config), engine_config.model.model_id)


def _serve(engine_config, server_config) -> int:
    # Imported here so that `--help` and flag errors don't wait for torch.
    from inference_service.models.loader import resolve_model

    resolve_model(engine_config.model)  # before the port opens: a wrong model id starts nothing
    from inference_service.api.server import StartupError, serve

    try:
        return asyncio.run(serve(server_config, engine_config))
    except StartupError as error:
        raise CommandFailed(str(error)) from None


DOWNLOAD_FLAGS = (
    Flag("--revision", "model.revision", "Hub revision: a commit, branch or tag.", default_text="the default branch"),
    Flag("--huggingface-hub-cache", "model.huggingface_hub_cache", "Hub cache folder.", default_text="the hub's"),
    Flag("--json-output", "server.json_output", "Log JSON lines instead of text.", parse_bool),
    Flag("--log-level", "server.log_level", "debug, info, warning or error."),
)


def _configure_download(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_id",
        nargs="?",
        metavar="MODEL_ID",
        help=f"hub id, local folder or .gguf file (default: $MODEL_ID, else {DEMO_MODEL_ID})",
    )
    add_flags(parser, DOWNLOAD_FLAGS, "download")


def _run_download(args: argparse.Namespace) -> int:
    values = resolve_flags(args, DOWNLOAD_FLAGS, dict(os.environ))
    values["--model-id"] = args.model_id or os.environ.get("MODEL_ID") or DEMO_MODEL_ID
    configs = build_configs(values, DOWNLOAD_FLAGS + MODEL_FLAGS[:1])
    configure_logging(configs["server"])
    from inference_service.models.loader import resolve_model

    resolved = resolve_model(configs["model"])
    print(resolved.path)
    return 0


def _configure_launch(parser: argparse.ArgumentParser) -> None:
    from gateway.launch import configure  # the gateway owns `launch`: its flags and its run

    configure(parser)


def _run_launch(args: argparse.Namespace) -> int:
    from gateway.command import run

    return run(args)


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: list[Command] = [
    Command(
        "serve", "serve the gRPC API (health, reflection, TextGeneration) on one model", _configure_serve, _run_serve
    ),
    Command("launch", "serve the gRPC API and TGI's REST API (through Envoy) together", _configure_launch, _run_launch),
    Command(
        "download-weights",
        "fetch (and convert) a model's weights into the cache, print its folder",
        _configure_download,
        _run_download,
    ),
]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        sub = commands.add_parser(command.name, help=command.help, description=command.help)
        command.configure(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if getattr(args, "run", None) is None:
            raise CliError(f"choose a command: {', '.join(c.name for c in COMMANDS)} (see --help)")
        return args.run(args)
    except CliError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (ModelLoadError, CommandFailed) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:  # a one-shot command cut short (serve and launch take signals themselves)
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
