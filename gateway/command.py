"""The `launch` command's entry (hooked into `inference_service.cli`): one engine in this process
(`gateway.launch`), or N replicas (`gateway.replicated`), behind Envoy."""

from __future__ import annotations

import argparse
import asyncio
import os

from gateway.envoy import GatewayError
from gateway.launch import launch, options_from_args
from gateway.replicated import launch_replicas
from inference_service import flags
from inference_service.api.stopping import run_until_stopped


def run(args: argparse.Namespace) -> int:
    engine_config, server_config = flags.configs_from_args(args)
    options = options_from_args(args, dict(os.environ))
    flags.configure_logging(server_config)
    flags.warn_of_command_line_secrets(args)
    return run_until_stopped(lambda: _launch(engine_config, server_config, options), engine_config.model.model_id)


def _launch(engine_config, server_config, options) -> int:
    from inference_service.models.loader import resolve_model

    # Found (fetched, converted) before any port opens, as TGI's launcher downloads before it starts
    # the shards and the router: a wrong model id is one line and exit 1, with nothing started.
    resolve_model(engine_config.model)
    from inference_service.api.server import StartupError  # the server's imports take a while

    try:
        if options.num_replicas > 1:
            return asyncio.run(launch_replicas(server_config, engine_config, options))
        return asyncio.run(launch(server_config, engine_config, options))
    except (StartupError, GatewayError) as error:
        raise flags.CommandFailed(str(error)) from None
