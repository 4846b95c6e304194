"""`launch --num-shard 2`: serves through Envoy, and when a shard is killed exits 1 (as TGI's
launcher does when a shard crashes), its other shard gone with it, never hanging; on the paged
runner (a tiny Llama) and on the fallback runner (a tiny GPT-J, transformers' attention)."""

from __future__ import annotations

import json
import os
import signal
import socket
import urllib.request
from pathlib import Path

import pytest

from tests.launched import Launched, alive
from tests.unit.tiny_models import tiny_model

START_TIMEOUT_S = 300  # the shards start and load too: minutes on a busy 2-core machine
EXIT_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def follower_pids(launcher_pid: int) -> list[int]:
    """The shards the launcher's fork server started (its children's children)."""
    pids = []
    for child in children_of(launcher_pid):
        if b"forkserver" in Path(f"/proc/{child}/cmdline").read_bytes():
            pids += children_of(child)
    return pids


@pytest.fixture(params=["paged", "fallback"])
def served_model_dir(request, tmp_path_factory, byte_tokenizer):
    if request.param == "paged":
        return request.getfixturevalue("tiny_model_dir")
    folder = tmp_path_factory.mktemp("gptj")
    ids = {name: getattr(byte_tokenizer, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    tiny_model("gptj", vocab_size=len(byte_tokenizer), **ids).save_pretrained(folder)
    byte_tokenizer.save_pretrained(folder)
    return folder


def test_a_killed_shard_stops_the_launcher_with_exit_code_1(served_model_dir):
    launched = Launched(served_model_dir, "--num-shard", "2", "--master-port", str(free_port()), "--num-threads", "1")
    try:
        ready = launched.wait_for(r"ready: TGI REST API on (\S+),", timeout_s=START_TIMEOUT_S)
        request = urllib.request.Request(
            f"{ready.group(1)}/generate",
            data=json.dumps({"inputs": "a", "parameters": {"max_new_tokens": 3}}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.load(response)["generated_text"]
        [follower] = follower_pids(launched.process.pid)
        os.kill(follower, signal.SIGKILL)
        assert launched.process.wait(EXIT_TIMEOUT_S) == 1
        launched.wait_for("not serving any more: the model can no longer run: shard-1 exited")
        assert not alive(follower)
    finally:
        launched.stop()
