"""A token's own bytes, for logprobs: a token may hold part of a UTF-8 character (byte-level BPE
splits `日` into three byte tokens), whose text alone is empty or U+FFFD; OpenAI's `bytes` field
tells the bytes themselves."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character → byte (the inverse of its `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_bytes_reader(tokenizer: Any) -> Callable[[int], bytes]:
    """id → the token's bytes (from its vocabulary piece; decoding it alone where that can't tell)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_level = "ByteLevel" in type(decoder).__name__ or "ByteLevel" in repr(decoder)
    table = _byte_level_table()

    @functools.lru_cache(maxsize=65536)
    def read(token_id: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if byte_level and all(char in table for char in piece):
                return bytes(table[char] for char in piece)
            match = _BYTE_PIECE.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
        return tokenizer.decode([token_id]).encode()

    return read
