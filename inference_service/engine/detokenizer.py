"""Generated token ids to text: incremental decoding, stop sequences, and what a stream may show.

Three layers, each usable alone:
- `IncrementalDetokenizer` turns one token id at a time into the text it adds, decoding a short
  window of ids (TGI's `decode_token`, vLLM's incremental detokenizer), so a token costs
  O(window) and never emits half a UTF-8 character.
- `StopChecker` finds stop sequences in the accumulated text as it grows, including a match that
  ends inside a token, and says how much of the tail could still become one.
- `TextState` is what the engine keeps per request: the text of each token, the final text, and
  how many token events a stream may show without ever showing text it would later cut.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context for the first generated tokens, so a decoder that treats the
# start of a text specially (SentencePiece's leading space) sees a mid-text token (TGI, vLLM).
NUM_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, so valid text never keeps a token pending this long; the
# bound keeps a run of invalid bytes from growing the window (it is then emitted as U+FFFD).
MAX_NUM_PENDING_TOKENS = 16


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids streamed with `special: true` and left out of the final text.

    TGI flags a token special when it is in `all_special_ids`; decoding with special tokens
    skipped drops every added token marked special. The union covers both.
    """
    ids = set(tokenizer.all_special_ids)
    ids.update(token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special)
    return frozenset(ids)


def decode(tokenizer: Any, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
    """Decode without clean-up of tokenization spaces.

    Clean-up rewrites text around punctuation depending on what follows, so a window-by-window
    decode would disagree with a whole decode; without it both agree.

    A fast tokenizer whose class keeps transformers' own `decode` calls the `tokenizers` decoder
    directly, which is all transformers does without clean-up: its argument checks and conversions
    cost 3x the decode itself, twice per token of every stream.
    """
    backend = _direct_backend(tokenizer)
    if backend is not None:
        return backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(
        list(token_ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def _direct_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` that transformers' decode would call, when nothing overrides the
    path to it (None: go through `tokenizer.decode`)."""
    kind = type(tokenizer)
    if kind not in _DIRECT:
        _DIRECT[kind] = (
            isinstance(tokenizer, TokenizersBackend)
            and kind.decode is PreTrainedTokenizerBase.decode
            and kind._decode is TokenizersBackend._decode
        )
    return getattr(tokenizer, "_tokenizer", None) if _DIRECT[kind] else None


_DIRECT: dict[type, bool] = {}  # tokenizer class → whether its decode is the backend's


class IncrementalDetokenizer:
    """Decodes generated tokens one at a time over a window of recent ids.

    The window holds the ids of the last released text (the prefix, decoded only as context)
    followed by the pending ids. A token's text is the window's decode minus the prefix's decode;
    while that ends in U+FFFD (an incomplete UTF-8 character) nothing is released and the text
    comes with a later token.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self._num_prefix_tokens = len(self._window)
        self._prefix_text: str | None = None  # decoded lazily, once per release

    @property
    def num_pending_tokens(self) -> int:
        """Tokens received whose text has not been released yet."""
        return len(self._window) - self._num_prefix_tokens

    @property
    def num_window_tokens(self) -> int:
        return len(self._window)

    def step(self, token_id: int) -> str:
        """Add one token; return the text it releases ("" while a character is incomplete)."""
        self._window.append(token_id)
        prefix_text = self._get_prefix_text()
        text = self._decode(self._window)
        if len(text) > len(prefix_text) and not text.endswith(REPLACEMENT_CHAR):
            self._release()
            return text[len(prefix_text) :]
        if self.num_pending_tokens >= MAX_NUM_PENDING_TOKENS:
            self._restart()
            return text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """The text of the pending tokens as a whole decode shows it (U+FFFD for a cut character)."""
        text = self._decode(self._window)[len(self._get_prefix_text()) :]
        self._restart()
        return text

    def _get_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._num_prefix_tokens])
        return self._prefix_text

    def _release(self) -> None:
        """The pending tokens become the next prefix; older ids are dropped (bounded window)."""
        del self._window[: self._num_prefix_tokens]
        self._num_prefix_tokens = len(self._window)
        self._prefix_text = None

    def _restart(self) -> None:
        """Forget all context: the next text is decoded on its own."""
        self._window.clear()
        self._num_prefix_tokens = 0
        self._prefix_text = ""

    def _decode(self, token_ids: Sequence[int]) -> str:
        return decode(self._tokenizer, token_ids, skip_special_tokens=self._skip_special_tokens)


def _kmp_failure(pattern: str) -> list[int]:
    """failure[i] = length of the longest proper prefix of pattern[:i+1] that is also its suffix."""
    failure = [0] * len(pattern)
    length = 0
    for i in range(1, len(pattern)):
        while length and pattern[i] != pattern[length]:
            length = failure[length - 1]
        if pattern[i] == pattern[length]:
            length += 1
        failure[i] = length
    return failure


class _StopMatcher:
    """One stop sequence as a KMP automaton: `state` = longest suffix of the text that is a prefix."""

    def __init__(self, stop: str):
        self.stop = stop
        self._failure = _kmp_failure(stop)
        self.state = 0

    def advance(self, char: str) -> bool:
        """Feed one character; True when the stop sequence now ends the text."""
        stop, state = self.stop, self.state
        while state and stop[state] != char:
            state = self._failure[state - 1]
        if stop[state] == char:
            state += 1
        self.state = state
        return state == len(stop)


class StopChecker:
    """Finds stop sequences in text fed piece by piece, at character granularity.

    A match is found as soon as it is complete, also when it ends inside a piece (TGI only
    checks at token ends and misses those). Cost is O(characters x stop sequences), amortized.
    Empty stop sequences are ignored: they would match before any text.
    """

    def __init__(self, stop_sequences: Sequence[str]):
        self._matchers = [_StopMatcher(stop) for stop in dict.fromkeys(stop_sequences) if stop]
        self.matched_stop: str | None = None

    def feed(self, text: str) -> int | None:
        """Add text; return how many of its characters to keep (through the end of the first
        match), or None when no stop sequence matched."""
        if self.matched_stop is not None:
            raise RuntimeError("text fed after a stop sequence matched")
        if not self._matchers:
            return None
        for index, char in enumerate(text):
            completed = [m.stop for m in self._matchers if m.advance(char)]
            if completed:
                self.matched_stop = max(completed, key=len)
                return index + 1
        return None

    @property
    def num_held_chars(self) -> int:
        """Trailing characters of the text so far that begin some stop sequence (0 after a match)."""
        if self.matched_stop is not None:
            return 0
        return max((m.state for m in self._matchers), default=0)


@dataclass(frozen=True)
class TokenText:
    """The text one generated token adds, and whether it completed a stop sequence."""

    text: str
    stop_matched: bool


class TextState:
    """A request's generated text, fed one token at a time by the engine.

    - Non-special tokens go through an `IncrementalDetokenizer` that skips special tokens, so
      their texts concatenate to the generated text decoded with special tokens skipped.
    - A special token's text is its own decode ("</s>"); it is not part of the final text and
      stop sequences are not matched against it.
    - When a stop sequence matches, the matching token's text ends right after it and the final
      text keeps it, as TGI's native routes do; `final_text(strip_stop=True)` drops it.

    So the concatenation of the streamed non-special token texts always equals `final_text()`.
    A character still incomplete when generation ends (a length limit in the middle of its
    bytes) is in neither.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], stop_sequences: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=True)
        self._stop_checker = StopChecker(stop_sequences)
        self._chunks: list[str] = []
        self._num_chars = 0
        self._num_tokens = 0
        self._num_releasable_tokens = 0
        self._held_token_ends: deque[int] = deque()  # text end offset of each token not releasable yet

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def matched_stop(self) -> str | None:
        """The stop sequence that ended the text, if one did."""
        return self._stop_checker.matched_stop

    def add(self, token_id: int, special: bool) -> TokenText:
        """Add one generated token; returns its text. Call no more after a stop matched."""
        if self.matched_stop is not None:
            raise RuntimeError("token added after a stop sequence matched")
        self._num_tokens += 1
        text = self._special_text(token_id) if special else self._append(self._detokenizer.step(token_id))
        self._held_token_ends.append(self._num_chars)
        self._update_releasable()
        return TokenText(text, self.matched_stop is not None)

    def num_releasable_tokens(self) -> int:
        """How many tokens, counted from the first, a stream may show now (never decreases).

        A token is held while its text reaches into a tail that may still grow into a stop
        sequence; it is released as soon as that tail can no longer be one, or when a stop
        matches. With no stop sequence pending every token is releasable at once. When the
        request finishes for any other reason (EOS, length) every token may be shown.
        """
        return self._num_releasable_tokens

    def final_text(self, *, strip_stop: bool = False) -> str:
        """The generated text: special tokens skipped, ending right after a matched stop sequence
        (TGI's native routes), or just before it with `strip_stop` (OpenAI-style routes)."""
        text = "".join(self._chunks)
        if strip_stop and self.matched_stop is not None:
            return text[: len(text) - len(self.matched_stop)]
        return text

    def _special_text(self, token_id: int) -> str:
        return decode(self._tokenizer, [token_id], skip_special_tokens=False)

    def _append(self, text: str) -> str:
        num_kept = self._stop_checker.feed(text)
        if num_kept is not None:
            text = text[:num_kept]
        self._chunks.append(text)
        self._num_chars += len(text)
        return text

    def _update_releasable(self) -> None:
        safe_end = self._num_chars - self._stop_checker.num_held_chars
        while self._held_token_ends and self._held_token_ends[0] <= safe_end:
            self._held_token_ends.popleft()
            self._num_releasable_tokens += 1
