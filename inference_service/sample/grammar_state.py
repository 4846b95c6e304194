"""One sequence's position in its grammar, and the token masks of a step's constrained rows.

A mask is a bitmask `[R, ceil(V / 32)]` int32 (bit j of word w allows token 32 * w + j), one row
per constrained sequence; the sampler turns it into -inf logits (`ops.apply_token_bitmask`).
Once a step's tokens are accepted, `prefetch_masks` fills the next step's masks on a background
thread while the model computes the next logits; `fill_bitmasks` then only collects them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.torch
import torch
from torch import Tensor

from inference_service.errors import GenerationError

MAX_ERROR_CHARS = 300  # the grammar engine's messages echo the grammar: only their start is told


def short_error(message: str | None, echoed: str = "") -> str:
    """A grammar engine message on one line, without the parser dump, `echoed` (the grammar, which
    messages quote) shortened, and cut to `MAX_ERROR_CHARS`."""
    text = (message or "").split("<state>")[0].replace("<non-verbose/>", "")
    if len(echoed) > 40:
        text = text.replace(echoed, echoed[:40] + "…")
    text = " ".join(text.split()) or "unknown error"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


class GrammarState:
    """One sequence's position in its grammar: fills its mask row, accepts its sampled tokens."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        # The mask of the current position, being filled in the background: (done, bitmask, row).
        self._prefetched: tuple[Future, Tensor, int] | None = None

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (CPU int32, contiguous)."""
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token; a token the grammar rejects is a `GenerationError`."""
        self._take_prefetched()  # the matcher is never read and advanced at once
        if not self.matcher.consume_token(token_id):
            raise GenerationError(
                f"token {token_id} does not match the request's grammar: {short_error(self.matcher.get_error())}"
            )

    @property
    def is_complete(self) -> bool:
        """The grammar is satisfied and allows nothing but EOS: the sequence is done."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def _take_prefetched(self) -> Tensor | None:
        """The prefetched mask row `[W]` of the current position (waiting for it), or None.

        None too when the background fill failed: it filled a group of rows at once, so one bad
        row fails them all; each row is then filled again on its own, where only the bad one fails.
        """
        if self._prefetched is None:
            return None
        done, bitmask, row = self._prefetched
        self._prefetched = None
        return bitmask[row] if done.exception() is None else None


_executor: llguidance.LLExecutor | None = None
_prefetcher: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def fill_bitmasks(states: Sequence[GrammarState], vocab_size: int) -> Tensor:
    """The masks of all constrained rows of a step `[R, ceil(V / 32)]`: the prefetched rows collected,
    the others filled together in llguidance's thread pool (a single row in place: no hand-off)."""
    bitmask = torch.empty(len(states), (vocab_size + 31) // 32, dtype=torch.int32)  # [R, W]
    missing = []
    for row, state in enumerate(states):
        prefetched = state._take_prefetched()
        if prefetched is None:
            missing.append(row)
        else:
            bitmask[row] = prefetched
    _fill([(states[row], row) for row in missing], bitmask)
    return bitmask


def prefetch_masks(states: Sequence[GrammarState], vocab_size: int) -> None:
    """Start filling the masks of `states`' current positions on the background thread; the next
    `fill_bitmasks` (or `accept`) of each state waits for its row. Complete grammars are skipped."""
    states = [s for s in states if s._prefetched is None and not s.is_complete]
    if not states:
        return
    bitmask = torch.empty(len(states), (vocab_size + 31) // 32, dtype=torch.int32)  # [R, W]
    done = _background().submit(_fill, [(state, row) for row, state in enumerate(states)], bitmask)
    for row, state in enumerate(states):
        state._prefetched = (done, bitmask, row)


def _fill(rows: list[tuple[GrammarState, int]], bitmask: Tensor) -> None:
    """Fill each (state, row): one row in place, several in llguidance's thread pool."""
    if len(rows) == 1:
        rows[0][0].fill_bitmask(bitmask, rows[0][1])
    elif rows:
        llguidance.torch.fill_next_token_bitmask_par(
            _shared_executor(), [(state.matcher, row) for state, row in rows], bitmask
        )


def _background() -> ThreadPoolExecutor:
    global _prefetcher
    with _executor_lock:
        if _prefetcher is None:
            _prefetcher = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return _prefetcher


def _shared_executor() -> llguidance.LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor
