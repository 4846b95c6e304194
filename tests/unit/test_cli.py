"""`inference-service` flag parsing: names, environment variables, defaults and one-line errors."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from inference_service import cli, flags
from inference_service.api.config import ServerConfig
from inference_service.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
KEY_FILE = Path(tempfile.mkdtemp(prefix="api-key-")) / "key"
KEY_FILE.write_text("s3cret-from-a-file\n")

# A valid value per flag, and the config field it must land in.
SAMPLES = {
    "--model-id": ("some/model", "some/model"),
    "--revision": ("abc123", "abc123"),
    "--dtype": ("bfloat16", "bfloat16"),
    "--device": ("cuda:1", "cuda:1"),
    "--trust-remote-code": (None, True),
    "--num-threads": ("3", 3),
    "--huggingface-hub-cache": ("/tmp/hub", "/tmp/hub"),
    "--chat-template": ("chat.jinja", "chat.jinja"),
    "--reasoning-parser": ("deepseek_r1", "deepseek_r1"),
    "--tool-call-parser": ("hermes", "hermes"),
    "--quantize": ("eetq", "eetq"),
    "--served-model-name": ("acme/chat", "acme/chat"),
    "--lora-adapters": ("fr=/a/fr,org/de", "fr=/a/fr,org/de"),
    "--max-lora-rank": ("16", 16),
    "--max-loras": ("4", 4),
    "--rope-scaling": ("dynamic", "dynamic"),
    "--rope-factor": ("2.5", 2.5),
    "--cuda-graphs": ("1,2,8", "1,2,8"),
    "--cuda-memory-fraction": ("0.8", 0.8),
    "--num-shard": ("2", 2),
    "--sharded": ("true", True),
    "--master-addr": ("10.0.0.2", "10.0.0.2"),
    "--master-port": ("29600", 29600),
    "--max-concurrent-requests": ("7", 7),
    "--max-best-of": ("3", 3),
    "--max-stop-sequences": ("6", 6),
    "--max-top-n-tokens": ("9", 9),
    "--max-input-tokens": ("100", 100),
    "--max-input-length": ("101", 101),
    "--max-total-tokens": ("200", 200),
    "--watermark-gamma": ("0.25", 0.25),
    "--watermark-delta": ("1.5", 1.5),
    "--disable-grammar-support": (None, True),
    "--grammar-compile-timeout-ms": ("500", 500),
    "--grammar-max-states": ("1000", 1000),
    "--max-images-per-request": ("3", 3),
    "--max-image-fetch-size": ("1000000", 1000000),
    "--max-batch-prefill-tokens": ("512", 512),
    "--max-batch-size": ("8", 8),
    "--waiting-served-ratio": ("1.2", 1.2),
    "--max-waiting-tokens": ("5", 5),
    "--max-batch-total-tokens": ("4096", 4096),
    "--kv-cache-memory": ("512MiB", "512MiB"),
    "--kv-cache-dtype": ("int8", "int8"),
    "--block-size": ("32", 32),
    "--prefix-caching": ("false", False),
    "--speculate": ("3", 3),
    "--hostname": ("127.0.0.1", "127.0.0.1"),
    "--grpc-port": ("6000", 6000),
    "--payload-limit": ("1000", 1000),
    "--graceful-termination-timeout": ("2.5", 2.5),
    "--json-output": (None, True),
    "--log-level": ("debug", "debug"),
    "--engine-core-process": ("false", False),
    "--otlp-endpoint": ("http://127.0.0.1:4317", "http://127.0.0.1:4317"),
    "--otlp-service-name": ("svc", "svc"),
    "--prometheus-port": ("9100", 9100),
    "--api-key": ("s3cret", "s3cret"),
    "--api-key-file": (str(KEY_FILE), "s3cret-from-a-file"),  # the line end is not the key's
    "--tls-cert": ("c.pem", "c.pem"),
    "--tls-key": ("k.pem", "k.pem"),
    "--tls-client-ca": ("ca.pem", "ca.pem"),
}


# Flags that only make sense with others: what a sample of them is parsed with.
COMPANIONS = {
    "--tls-cert": ["--tls-key", "k.pem"],
    "--tls-key": ["--tls-cert", "c.pem"],
    "--tls-client-ca": ["--tls-cert", "c.pem", "--tls-key", "k.pem"],
}


def parse(argv: list[str], environ: dict[str, str] | None = None) -> tuple[EngineConfig, ServerConfig]:
    args = cli.build_parser().parse_args(["serve", *argv])
    return flags.configs_from_args(args, environ={} if environ is None else environ)


def field_value(engine: EngineConfig, server: ServerConfig, target: str):
    area, name = target.split(".")
    return getattr(server if area == "server" else getattr(engine, area), name)


def test_defaults_are_the_config_defaults():
    assert parse([]) == (EngineConfig(), ServerConfig())
    assert ServerConfig().grpc_port == 50051 and ServerConfig().hostname == "0.0.0.0"


def test_every_serve_flag_has_a_sample():
    assert set(SAMPLES) == {flag.name for flag in flags.SERVE_FLAGS}


@pytest.mark.parametrize("flag", flags.SERVE_FLAGS, ids=lambda f: f.name)
def test_flag_sets_its_field(flag):
    text, expected = SAMPLES[flag.name]
    argv = [flag.name] if text is None else [flag.name, text]
    engine, server = parse(argv + COMPANIONS.get(flag.name, []))
    assert field_value(engine, server, flag.target) == expected


@pytest.mark.parametrize("flag", flags.SERVE_FLAGS, ids=lambda f: f.name)
def test_environment_variable_sets_its_field(flag):
    text, expected = SAMPLES[flag.name]
    engine, server = parse(COMPANIONS.get(flag.name, []), {flag.env: "true" if text is None else text})
    assert field_value(engine, server, flag.target) == expected


def test_the_api_key_stays_out_of_reprs():
    _engine, server = parse([], {"API_KEY": "s3cret"})
    assert server.api_key == "s3cret" and "s3cret" not in repr(server)


def test_the_api_key_from_a_file_and_not_from_two_places(tmp_path):
    with pytest.raises(flags.CliError, match="--api-key and --api-key-file are the same setting"):
        parse(["--api-key", "a", "--api-key-file", str(KEY_FILE)])
    with pytest.raises(flags.CliError, match="a readable file"):
        parse(["--api-key-file", str(tmp_path / "missing")])
    with pytest.raises(flags.CliError, match="API_KEY_FILE=.*a readable file"):
        parse([], {"API_KEY_FILE": str(tmp_path / "missing")})


def test_env_names_are_tgi_style():
    names = {flag.name: flag.env for flag in flags.SERVE_FLAGS}
    assert names["--model-id"] == "MODEL_ID"
    assert names["--max-total-tokens"] == "MAX_TOTAL_TOKENS"
    assert names["--huggingface-hub-cache"] == "HUGGINGFACE_HUB_CACHE"


def test_flag_wins_over_environment():
    engine, _ = parse(["--max-total-tokens", "300"], {"MAX_TOTAL_TOKENS": "400"})
    assert engine.limits.max_total_tokens == 300


def test_false_boolean_variable():
    _, server = parse([], {"JSON_OUTPUT": "false"})
    assert server.json_output is False


def test_short_graceful_termination_flag():
    _, server = parse(["-g", "3"])
    assert server.graceful_termination_timeout == 3.0


def run_main(argv: list[str], monkeypatch, capsys, environ: dict[str, str] | None = None) -> tuple[int, str]:
    for flag in flags.SERVE_FLAGS:
        monkeypatch.delenv(flag.env, raising=False)
    for key, value in (environ or {}).items():
        monkeypatch.setenv(key, value)
    code = cli.main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["serve", "--max-total-tokens", "abc"], {}, "argument --max-total-tokens: expected an integer, not 'abc'"),
        (["serve", "--bogus"], {}, "unrecognized arguments: --bogus"),
        (["serve", "--max-input-tokens", "3", "--max-input-length", "4"], {}, "give only one"),
        (["serve", "--max-input-tokens", "3"], {"MAX_INPUT_LENGTH": "4"}, "give only one"),
        (["serve"], {"MAX_TOTAL_TOKENS": "x"}, "MAX_TOTAL_TOKENS='x': expected an integer"),
        (["serve"], {"TRUST_REMOTE_CODE": "maybe"}, "TRUST_REMOTE_CODE='maybe': expected true or false"),
        (["serve", "--dtype", "int8"], {}, "--dtype must be auto, float32, bfloat16 or float16"),
        (["serve", "--max-input-tokens", "10", "--max-total-tokens", "10"], {}, "must be < `max_total_tokens`"),
        (["serve", "--grpc-port", "70000"], {}, "--grpc-port must be in [0, 65535]"),
        (["serve", "--kv-cache-memory", "lots"], {}, "--kv-cache-memory must be a fraction"),
        (["serve", "--kv-cache-dtype", "int4"], {}, "--kv-cache-dtype must be one of auto, fp32"),
        (["serve", "--kv-cache-dtype", "fp8_e4m3fn"], {}, "this server's 8-bit KV cache is int8"),
        (["serve", "--rope-scaling", "yarn"], {}, "--rope-scaling must be linear or dynamic"),
        (["serve", "--rope-factor", "0"], {}, "--rope-factor must be a number > 0"),
        (["serve", "--cuda-graphs", "1,x"], {}, "--cuda-graphs must be batch sizes"),
        (["serve", "--cuda-memory-fraction", "1.5"], {}, "--cuda-memory-fraction must be in (0, 1]"),
        ([], {}, "choose a command"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(argv, environ, message, monkeypatch, capsys):
    code, err = run_main(argv, monkeypatch, capsys, environ)
    assert code == cli.EXIT_USAGE
    assert err.count("\n") == 1 and err.startswith("inference-service: error: ")
    assert message in err


def test_download_weights_of_a_missing_folder_is_one_line(monkeypatch, capsys, tmp_path):
    code, err = run_main(["download-weights", str(tmp_path / "nope")], monkeypatch, capsys)
    assert code == cli.EXIT_FAILURE
    assert err.strip().splitlines()[-1].startswith("inference-service: error: ")
    assert "Traceback" not in err


def test_download_weights_of_a_local_folder_prints_it(monkeypatch, capsys, tmp_path):
    code = cli.main(["download-weights", str(tmp_path)])
    assert code == 0
    assert capsys.readouterr().out.strip() == str(tmp_path.resolve())


def test_serve_with_an_unloadable_model_exits_1_without_traceback(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "inference_service",
            "serve",
            "--model-id",
            str(tmp_path),
            "--hostname",
            "127.0.0.1",
            "--grpc-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == cli.EXIT_FAILURE, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("inference-service: error: ")
    assert "Traceback" not in result.stderr


def test_help_explains_every_flag(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in flags.SERVE_FLAGS:
        assert flag.name in out and f"[env: {flag.env}]" in out


def test_api_key_help_names_every_guarded_call_and_route():
    from inference_service.api.auth import GUARDED_METHODS

    [flag] = [flag for flag in flags.SERVE_FLAGS if flag.name == "--api-key"]
    guarded, open_part = flag.help.split("Open without it")
    names = re.findall(r"\b[A-Z][A-Za-z]+\b", guarded)
    assert {method.rsplit("/", 1)[-1] for method in GUARDED_METHODS} <= set(names)
    routes = (
        "/generate",
        "/generate_stream",
        "/tokenize",
        "/invocations",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    )
    for path in routes:
        assert path in guarded and path not in open_part


def test_readme_flag_table_matches_the_code():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- flags:start -->")[1].split("<!-- flags:end -->")[0]
    rows = re.findall(r"^\| `(--[a-z-]+)`[^|]*\| `([A-Z_]+)` \|", table, flags=re.MULTILINE)
    assert rows == [(flag.name, flag.env) for flag in flags.SERVE_FLAGS]
