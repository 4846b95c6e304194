"""Malformed gRPC requests sent as raw bytes over HTTP/2, to the server's port and through Envoy, each
while an innocent gRPC stream runs beside it on its own connection (through Envoy: on the same
Envoy → server connection): every malformed call gets a typed status at once (never UNKNOWN, never a
hang), and the stream's tokens are those it produces alone.

Two layers:
- the gRPC message framing inside a valid HTTP/2 stream (a 5-byte prefix: compressed flag, length),
  sent with `curl --http2-prior-knowledge`, which prints the trailers;
- HTTP/2 frames that break the protocol, written on a raw socket (hand-built frames): the hop answers
  with GOAWAY or RST_STREAM on that connection alone.

An empty body or a message cut short used to hang the call until the caller gave up: grpc.aio waits
for a unary request's message past the end of the stream (api/decoding.py).
"""

from __future__ import annotations

import socket
import struct
import subprocess
import threading

import grpc
import pytest

from textgen.v1 import generate_pb2 as pb
from textgen.v1 import generate_pb2_grpc

TIMEOUT = 60
# The tiny model greedily generates from "a" to the length limit without an EOS: a long stream.
BYSTANDER = pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(max_new_tokens=300))
GOOD = pb.GenerateRequest(inputs="hi", parameters=pb.GenerateParameters(max_new_tokens=2)).SerializeToString()
PAYLOAD_LIMIT = 2_000_000  # --payload-limit's default


def framed(data: bytes, *, compressed: bool = False, length: int | None = None) -> bytes:
    """A gRPC length-prefixed message: its compressed flag, its 4-byte length, its bytes."""
    return bytes([compressed]) + struct.pack(">I", len(data) if length is None else length) + data


OVERSIZE = pb.GenerateRequest(inputs="x" * PAYLOAD_LIMIT).SerializeToString()
# case: (request body, extra headers, the status every hop must answer)
CASES = {
    "well formed": (framed(GOOD), (), "0"),
    "no message": (b"", (), "3"),
    "a prefix cut short": (b"\x00\x00", (), "3"),
    "a length past the end": (framed(GOOD, length=1000), (), "3"),
    "a message cut short": (framed(GOOD)[:8], (), "3"),
    "garbage protobuf": (framed(b"\xff\xff\xff"), (), "3"),
    "compressed flag, no encoding": (framed(GOOD, compressed=True), (), "13"),  # gRPC's spec: INTERNAL
    "gzip flag, not gzip": (framed(GOOD, compressed=True), ("grpc-encoding: gzip",), "13"),
    "a length over the limit": (framed(b"\x0a", length=100_000_000), (), "8"),
    "a message over the limit": (framed(OVERSIZE), (), "8"),
}
METHODS = ("Generate", "GenerateStream")


@pytest.fixture(scope="module")
def targets(tiny_chat_grpc_server, start_gateway) -> dict[str, int]:
    """Where raw calls go: the server's port, and Envoy's (which passes gRPC through)."""
    return {"server": tiny_chat_grpc_server.port, "envoy": start_gateway(tiny_chat_grpc_server).envoy.port}


@pytest.fixture(scope="module")
def alone(tiny_chat_grpc_server):
    tokens = [m.token.id for m in tiny_chat_grpc_server.stub.GenerateStream(BYSTANDER, timeout=TIMEOUT)]
    assert len(tokens) == 300
    return tokens


class Bystander:
    """The innocent stream, read on a thread; a new one starts whenever the last one is done, so that
    every malformed call starts beside a running stream."""

    def __init__(self, stub):
        self._stub = stub
        self.finished: list[list[int]] = []
        self._start()

    def _start(self) -> None:
        stream = self._stub.GenerateStream(BYSTANDER, timeout=TIMEOUT)
        self.tokens = [next(stream).token.id]  # running: it has its first token
        self._thread = threading.Thread(target=lambda: self.tokens.extend(m.token.id for m in stream))
        self._thread.start()

    def running(self) -> None:
        if not self._thread.is_alive():
            self.finished.append(self.tokens)
            self._start()

    def finish(self) -> list[list[int]]:
        self._thread.join(TIMEOUT)
        return [*self.finished, self.tokens]


def raw_call(port: int, method: str, body: bytes, headers: tuple[str, ...], tmp_path) -> tuple[str | None, str]:
    """(grpc-status, grpc-message) of one call with `body` as its bytes; None: no status came."""
    path = tmp_path / "body.bin"
    path.write_bytes(body)
    command = ["curl", "-sv", "--http2-prior-knowledge", "--max-time", "20", "-o", "/dev/null"]
    command += [f"http://127.0.0.1:{port}/textgen.v1.TextGeneration/{method}", "--data-binary", f"@{path}"]
    for header in ("content-type: application/grpc", "te: trailers", *headers):
        command += ["-H", header]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    received = dict(
        line[2:].split(": ", 1) for line in done.stderr.splitlines() if line.startswith("< grpc-") and ": " in line
    )
    return received.get("grpc-status"), received.get("grpc-message", "")


@pytest.mark.parametrize("target", ["server", "envoy"])
def test_malformed_grpc_messages_get_a_typed_status_and_hurt_no_one(
    tiny_chat_grpc_server, targets, alone, target, tmp_path
):
    server, port = tiny_chat_grpc_server, targets[target]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        bystander = Bystander(generate_pb2_grpc.TextGenerationStub(channel))
        answers, expected = {}, {}
        for case, (body, headers, status) in CASES.items():
            for method in METHODS:
                bystander.running()
                code, message = raw_call(port, method, body, headers, tmp_path)
                answers[case, method], expected[case, method] = code, status
                assert "Error:" not in message and "Traceback" not in message, message
        streams = bystander.finish()
    assert answers == expected
    assert streams == [alone] * len(streams)
    assert server.wait_idle().num_free_blocks == server.stats().num_total_blocks


# -- HTTP/2 frames that break the protocol ----------------------------------------------------------
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x7
END_STREAM, END_HEADERS = 0x1, 0x4


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id) + payload


BROKEN_CONNECTIONS = {
    "headers that are not HPACK": frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff\xff"),
    "data on a stream never opened": frame(DATA, END_STREAM, 1, framed(GOOD)),
    "a frame over the maximum size": frame(DATA, 0, 1, b"\x00" * 20_000),  # SETTINGS_MAX_FRAME_SIZE: 16,384
    "settings of the wrong size": frame(SETTINGS, 0, 0, b"\x00\x01\x00"),
}
# How each hop ends such a connection. grpc's own HTTP/2 ignores DATA on a stream never opened (RFC
# 9113 makes it a connection error): that connection stays open, idle, until its idle limits close it.
ENDINGS = {
    "server": {
        "headers that are not HPACK": "rst_stream",
        "data on a stream never opened": "no answer",
        "a frame over the maximum size": "closed",
        "settings of the wrong size": "closed",
    },
    "envoy": dict.fromkeys(BROKEN_CONNECTIONS, "goaway"),
}


def connection_ending(port: int, data: bytes) -> str:
    """How the hop answers: "goaway" or "rst_stream" (the frame), "closed" (the connection, without
    one), or "no answer" (still open after a while)."""
    with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
        sock.sendall(PREFACE + frame(SETTINGS, 0, 0) + data)  # the preface, empty SETTINGS, the case
        buffer = b""
        while True:
            while len(buffer) >= 9:
                length, kind = int.from_bytes(buffer[:3], "big"), buffer[3]
                if kind in (GOAWAY, RST_STREAM):
                    return "goaway" if kind == GOAWAY else "rst_stream"
                if len(buffer) < 9 + length:
                    break
                buffer = buffer[9 + length :]
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return "no answer"
            except ConnectionResetError:
                return "closed"
            if not chunk:
                return "closed"
            buffer += chunk


@pytest.mark.parametrize("target", ["server", "envoy"])
def test_broken_http2_frames_end_their_connection_alone(tiny_chat_grpc_server, targets, alone, target):
    server, port = tiny_chat_grpc_server, targets[target]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        bystander = Bystander(stub)
        answered = {}
        for case, data in BROKEN_CONNECTIONS.items():
            bystander.running()
            answered[case] = connection_ending(port, data)
        streams = bystander.finish()
        assert stub.Generate(pb.GenerateRequest.FromString(GOOD), timeout=TIMEOUT).generated_text is not None
    assert answered == ENDINGS[target]
    assert streams == [alone] * len(streams)
    assert server.wait_idle().num_free_blocks == server.stats().num_total_blocks
