"""The batched sampler: per-request parameters become per-row tensors over one `[B, V]` pass.

Rows with a grammar first get their token bitmask (disallowed ids become -inf), all masks of the
step filled together; free rows skip it and pay nothing. Then OpenAI's logit bias; as TGI:
watermark, repetition penalty, frequency penalty; OpenAI's presence penalty (generated tokens
only); temperature, top-k, top-p, typical-p. Each step is applied only to the rows that enable
it. Greedy rows take the argmax of the processed logits (biases, penalties and watermark apply to
them too); sampling rows draw one uniform from their request's own generator,
so a seeded request's tokens do not depend on its batch, and drawn once per position, so sampling
a position again (the engine retries a failed batch row by row) draws the same token.

A row with no token left to choose (every logit -inf or NaN after its grammar and processors) is
not given an arbitrary token: the call raises `GenerationError` (the engine then finds the row).

Reported logprobs are RAW: `log_softmax` of the model's logits before any grammar mask, penalty,
temperature or filter (vLLM's default), for the chosen token and for the top-n alternatives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from inference_service.errors import GenerationError
from inference_service.sample import ops
from inference_service.sample.grammar_state import GrammarState, fill_bitmasks, prefetch_masks
from inference_service.sample.watermark import Watermark
from inference_service.sampling_params import SamplingParams


class SamplingState:
    """One request's sampling state, owned by the model runner; call `append` after each token.

    Holds the request's generator (sampling requests only), the counts and distinct ids of the
    tokens seen in prompt + output (penalties only), the distinct generated ids (presence penalty),
    the previous token (watermark), the total length (frequency penalty) and the grammar's position
    (constrained requests only).
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
        grammar: GrammarState | None = None,
    ) -> None:
        if params.watermark and not prompt_token_ids:
            raise ValueError("the watermark needs at least one prompt token to seed its greenlist")
        self.params = params
        self.vocab_size = vocab_size
        self.grammar = grammar
        self.generator: torch.Generator | None = None
        if not params.is_greedy:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(params.seed)
        self.token_counts: Tensor | None = None  # [V] int32
        self._seen: dict[int, None] = {}  # distinct ids, in first-seen order
        self._seen_ids = torch.empty(0, dtype=torch.int64, device=device)  # [U] a prefix of _seen
        if params.has_penalties:
            # Ids outside the logits cannot be generated, so they are not penalized (as transformers).
            self._seen = dict.fromkeys(int(t) for t in prompt_token_ids if 0 <= t < vocab_size)
            ids = torch.tensor([int(t) for t in prompt_token_ids if 0 <= t < vocab_size], dtype=torch.int64)
            self.token_counts = torch.bincount(ids, minlength=vocab_size).to(torch.int32).to(device)
        # OpenAI's presence penalty counts the output only; None when the request has none.
        self.generated_ids: dict[int, None] | None = {} if params.presence_penalty != 0.0 else None
        self.last_token_id: int | None = int(prompt_token_ids[-1]) if prompt_token_ids else None
        self.num_tokens = len(prompt_token_ids)
        self.num_generated = 0
        self._forced = dict(params.forced_token_ids)
        self._uniform: Tensor | None = None  # this position's draw, until a token is appended

    def append(self, token_id: int) -> None:
        """Record a generated token; a token the grammar rejects raises `GenerationError` first."""
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if self.token_counts is not None and 0 <= token_id < self.vocab_size:
            self.token_counts[token_id] += 1
            self._seen.setdefault(token_id)
        if self.generated_ids is not None and 0 <= token_id < self.vocab_size:
            self.generated_ids.setdefault(token_id)
        self.last_token_id = token_id
        self.num_tokens += 1
        self.num_generated += 1
        self._uniform = None

    def uniform(self) -> Tensor:
        """This position's uniform `[1]` from the request's generator (sampling requests only),
        drawn once: sampling the position again reuses it."""
        assert self.generator is not None, "greedy requests draw nothing"
        if self._uniform is None:
            self._uniform = torch.rand(1, generator=self.generator)
        return self._uniform

    @property
    def forced_token_id(self) -> int | None:
        """The token the next output position must take, if one is forced there."""
        return self._forced.get(self.num_generated) if self._forced else None

    @property
    def previous_token_id(self) -> int:
        """The last token, prompt or output: the watermark's seed (a watermark request has a prompt)."""
        assert self.last_token_id is not None, "no token yet: SamplingState refuses a watermark without a prompt"
        return self.last_token_id

    @property
    def num_seen(self) -> int:
        return len(self._seen)

    @property
    def first_seen_id(self) -> int:
        return next(iter(self._seen))

    def seen_token_ids(self) -> Tensor:
        """The distinct ids seen so far `[U]` (penalties only); grows only when a new id appears."""
        if len(self._seen_ids) < len(self._seen):
            new_ids = list(self._seen)[len(self._seen_ids) :]
            self._seen_ids = torch.cat([self._seen_ids, torch.tensor(new_ids, device=self._seen_ids.device)])
        return self._seen_ids

    def seen_token_counts(self, token_ids: Tensor) -> Tensor:
        """How often each of `token_ids` was seen, in prompt + output (penalties only)."""
        assert self.token_counts is not None, "the counts are kept for requests with penalties only"
        return self.token_counts.gather(0, token_ids)


class RowStats(Protocol):
    """Per row of fp32 logits [B, V]: (first argmax [B] int64, max [B], log(sum(exp(x - max))) [B]), as
    torch.max and log_softmax give them (the engine hands in worker/kernels' native pass)."""

    def takes(self, logits: Tensor) -> bool: ...

    def __call__(self, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]: ...


@dataclass
class SamplerOutput:
    """Per row: the chosen token, its raw logprob, and the raw top-n (empty lists unless asked)."""

    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class Sampler:
    """Chooses one token per row of `[B, V]` logits, each row with its own request's parameters."""

    def __init__(
        self,
        vocab_size: int,
        watermark_gamma: float = 0.5,
        watermark_delta: float = 2.0,
        candidate_tiers: tuple[int, ...] = ops.CANDIDATE_TIERS,
        row_stats: RowStats | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.watermark = Watermark(vocab_size, watermark_gamma, watermark_delta)
        self.candidate_tiers = candidate_tiers  # () = always the full sort
        self.row_stats = row_stats  # a native pass the engine hands in (CPU); None: torch's ops

    def __call__(self, logits: Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        """Sample one token per row.

        Rows are selected from the parameters on the host; off CPU the only sync is the final
        read of the results (whether each row had a token to choose included). On CPU, top-p also
        reads which rows its candidates decided.
        """
        if logits.dim() != 2 or logits.shape != (len(states), self.vocab_size):
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match {len(states)} rows of vocab size {self.vocab_size}"
            )
        logits = logits.float()  # [B, V]
        params = [s.params for s in states]
        allowed = self.apply_grammars(logits, states)  # [B, V]; logprobs stay those of the raw logits
        # Each raw row's argmax, max and log-sum-exp, where a native pass gives them and no row asks for
        # its top-n: the chosen tokens' raw logprobs are then x - max - log_sum, log_softmax's formula.
        stats = None
        if self.row_stats is not None and self.row_stats.takes(logits) and not any(p.top_n_tokens for p in params):
            stats = self.row_stats(logits)
        if all(p.is_greedy and not p.changes_logits for p in params):
            if stats is not None and allowed is logits:
                token_ids, chosen_logits = stats[0], stats[1]  # [B] each
            else:
                chosen_logits, token_ids = allowed.max(dim=-1)  # [B] each: the argmax and its logit, one op
        else:
            chosen_from = self.process(allowed, states)
            token_ids = self._choose(chosen_from, states)  # [B]
            chosen_logits = chosen_from.gather(1, token_ids[:, None]).view(-1)  # [B]
        forced = [(row, s.forced_token_id) for row, s in enumerate(states) if s.forced_token_id is not None]
        if forced:  # after the draw, so a seeded request's random stream is the same either way
            rows, ids = zip(*forced, strict=True)
            token_ids[list(rows)] = torch.tensor(ids, dtype=token_ids.dtype, device=token_ids.device)
        output, unchosen = _gather_output(logits, token_ids, chosen_logits, params, stats)
        # A chosen logit at -inf (every token was) or NaN (the model's logits were): nothing to choose.
        # Read with the step's one transfer; a forced token is chosen whatever its logit.
        if unchosen and any(row not in dict(forced) for row in unchosen):
            raise GenerationError(
                "no token could be sampled: the request's grammar and parameters left every token's"
                " logit at -inf or NaN"
            )
        return output

    def apply_grammars(self, logits: Tensor, states: Sequence[SamplingState]) -> Tensor:
        """The logits with -inf where a row's grammar disallows (a new tensor; `logits` itself when
        no row has a grammar)."""
        grammars = {i: s.grammar for i, s in enumerate(states) if s.grammar is not None}
        if not grammars:
            return logits
        bitmask = fill_bitmasks(list(grammars.values()), self.vocab_size)  # [R, W] on CPU
        bitmask = bitmask.to(logits.device, non_blocking=True)
        return _update_rows(logits.clone(), list(grammars), lambda sub: ops.apply_token_bitmask(sub, bitmask))

    def prefetch_grammars(self, states: Sequence[SamplingState]) -> None:
        """After a step's tokens are appended: start the next masks of the rows with a grammar, to be
        filled while the model runs."""
        grammars = [s.grammar for s in states if s.grammar is not None]
        if grammars:
            prefetch_masks(grammars, self.vocab_size)

    def process(self, logits: Tensor, states: Sequence[SamplingState]) -> Tensor:
        """The logits each row samples from, after its request's processors (a new tensor)."""
        params = [s.params for s in states]
        x = ops.finite_logits(logits)  # [B, V] a copy; the model's NaN/inf cannot reach a softmax
        rows = _rows(params, lambda p: bool(p.logit_bias))
        if rows:
            ids = _padded([[t for t, _ in params[i].logit_bias] for i in rows], x.device)
            bias = _padded([[b for _, b in params[i].logit_bias] for i in rows], x.device, torch.float32)
            x = _update_rows(x, rows, lambda sub: ops.apply_logit_bias(sub, ids, bias))
        rows = _rows(params, lambda p: p.watermark)
        if rows:
            previous = [states[i].previous_token_id for i in rows]
            x = _update_rows(x, rows, lambda sub: self.watermark.apply(sub, previous))
        x = _apply_penalties(x, states)
        generated = {i: s.generated_ids for i, s in enumerate(states) if s.generated_ids}
        if generated:
            ids = _padded([list(g) for g in generated.values()], x.device)
            penalty = _param(x, [params[i].presence_penalty for i in generated], torch.float32)
            x = _update_rows(x, list(generated), lambda sub: ops.apply_presence_penalty(sub, ids, penalty))
        rows = _rows(params, lambda p: p.temperature != 1.0)
        if rows:
            temperature = _param(x, [params[i].temperature for i in rows], torch.float32)
            x = _update_rows(x, rows, lambda sub: ops.apply_temperature(sub, temperature))
        rows = _rows(params, lambda p: p.top_k != 0 or p.top_p < 1.0)
        if rows:
            x = _update_rows(x, rows, self._top_k_top_p_fn([params[i] for i in rows], x))
        rows = _rows(params, lambda p: p.typical_p < 1.0)
        if rows:
            typical_p = _param(x, [params[i].typical_p for i in rows], torch.float32)
            x = _update_rows(x, rows, lambda sub: ops.apply_typical_p(sub, typical_p))
        return x

    def _top_k_top_p_fn(self, params: list[SamplingParams], x: Tensor) -> Callable[[Tensor], Tensor]:
        """Candidates on CPU, where a full sort is slow; elsewhere the full sort, which reads
        nothing back to the host."""
        top_k = _param(x, [p.top_k for p in params], torch.int64)
        top_p = _param(x, [p.top_p for p in params], torch.float64)
        if x.device.type == "cpu":
            return lambda sub: ops.apply_top_k_top_p(sub, top_k, top_p, self.candidate_tiers)
        max_top_k = max(p.top_k for p in params)
        return lambda sub: ops.apply_top_p(ops.apply_top_k(sub, top_k, max_top_k), top_p)

    def _choose(self, processed: Tensor, states: Sequence[SamplingState]) -> Tensor:
        """Argmax for greedy rows, inverse CDF with the request's own uniform for the others."""
        sampled = [i for i, s in enumerate(states) if s.generator is not None]
        if not sampled:
            return processed.argmax(dim=-1)  # [B]
        uniforms = torch.cat([states[i].uniform() for i in sampled])  # [S]
        uniforms = uniforms.to(processed.device)
        if len(sampled) == len(states):
            return ops.sample_from_logits(processed, uniforms)  # [B]
        token_ids = processed.argmax(dim=-1)  # [B]
        index = torch.tensor(sampled, device=processed.device)  # [S]
        token_ids[index] = ops.sample_from_logits(processed[index], uniforms)
        return token_ids


def _apply_penalties(x: Tensor, states: Sequence[SamplingState]) -> Tensor:
    """Repetition then frequency penalty, on the rows that set them, over their seen ids only."""
    rows = [i for i, s in enumerate(states) if s.params.has_penalties and s.num_seen > 0]
    if not rows:
        return x
    token_ids, token_counts = _seen_tokens([states[i] for i in rows])  # [R, T], [R, T]
    params = [states[i].params for i in rows]
    rep = _rows(params, lambda p: p.repetition_penalty != 1.0)
    if rep:
        penalty = _param(x, [params[j].repetition_penalty for j in rep], torch.float32)
        ids = _take(token_ids, rep)  # [r, T]
        x = _update_rows(x, [rows[j] for j in rep], lambda sub: ops.apply_repetition_penalty(sub, ids, penalty))
    freq = _rows(params, lambda p: p.frequency_penalty != 0.0)
    if freq:
        penalty = _param(x, [params[j].frequency_penalty for j in freq], torch.float32)
        total_lens = _param(x, [states[rows[j]].num_tokens for j in freq], torch.float32)
        ids, counts = _take(token_ids, freq), _take(token_counts, freq)  # [f, T], [f, T]
        x = _update_rows(
            x, [rows[j] for j in freq], lambda sub: ops.apply_frequency_penalty(sub, ids, counts, total_lens, penalty)
        )
    return x


def _seen_tokens(states: Sequence[SamplingState]) -> tuple[Tensor, Tensor]:
    """Each row's distinct seen ids and their counts, padded by repeating the row's first id."""
    seen = [s.seen_token_ids() for s in states]
    width = max(len(ids) for ids in seen)
    token_ids = torch.stack(
        [
            torch.nn.functional.pad(ids, (0, width - len(ids)), value=s.first_seen_id)
            for s, ids in zip(states, seen, strict=True)
        ]
    )  # [R, T]
    token_counts = torch.stack([s.seen_token_counts(ids) for s, ids in zip(states, token_ids, strict=True)])  # [R, T]
    return token_ids, token_counts


def _padded(rows: Sequence[Sequence[float]], device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """Ragged rows (of ids, or of their values) as one `[R, T]` tensor, each row padded by repeating its
    first entry, which scatters the same result twice."""
    width = max(len(row) for row in rows)
    return torch.tensor([list(row) + list(row[:1]) * (width - len(row)) for row in rows], dtype=dtype, device=device)


def _take(t: Tensor, rows: list[int]) -> Tensor:
    return t if len(rows) == t.shape[0] else t[torch.tensor(rows, device=t.device)]


def _rows(params: Sequence[SamplingParams], wants: Callable[[SamplingParams], bool]) -> list[int]:
    return [i for i, p in enumerate(params) if wants(p)]


def _param(x: Tensor, values: list, dtype: torch.dtype) -> Tensor:
    return torch.tensor(values, dtype=dtype, device=x.device)  # [R]


def _update_rows(x: Tensor, rows: list[int], fn: Callable[[Tensor], Tensor]) -> Tensor:
    """Apply `fn` to the given rows of `x` only (in place for a subset)."""
    if len(rows) == x.shape[0]:
        return fn(x)
    index = torch.tensor(rows, device=x.device)  # [R]
    x[index] = fn(x[index])
    return x


def _gather_output(
    logits: Tensor,
    token_ids: Tensor,
    chosen_logits: Tensor,
    params: Sequence[SamplingParams],
    stats: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[SamplerOutput, list[int]]:
    """Raw logprobs of the chosen tokens and the top-n, read back to the host in one transfer with
    the logits the tokens were chosen at; and the rows whose chosen logit is -inf or NaN. With the
    rows' `stats` (no top-n asked), the logprobs come from them, not from a whole log_softmax."""
    if stats is not None:
        _, maxes, log_sums = stats
        logprobs = (logits.gather(1, token_ids[:, None]).squeeze(1) - maxes) - log_sums  # [B]
    else:
        raw_logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
        logprobs = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)  # [B]
    top_rows = _rows(params, lambda p: p.top_n_tokens > 0)
    width = min(max((params[i].top_n_tokens for i in top_rows), default=0), logits.shape[-1])
    # One float64 vector (cat promotes the float32 parts itself): ids are exact below 2**53.
    parts = [token_ids.double(), logprobs, chosen_logits]
    if top_rows:
        index = torch.tensor(top_rows, device=logits.device)  # [N]
        top_logprobs, top_ids = raw_logprobs[index].topk(width, dim=-1)  # [N, width]
        parts += [top_ids.flatten(), top_logprobs.flatten()]
    flat = torch.cat(parts).tolist()
    num_rows = len(params)
    unchosen = [row for row, value in enumerate(flat[2 * num_rows : 3 * num_rows]) if not value > ops.NEG_INF]
    top_ids_list: list[list[int]] = [[] for _ in params]
    top_logprobs_list: list[list[float]] = [[] for _ in params]
    ids_start = 3 * num_rows
    logprobs_start = ids_start + len(top_rows) * width
    for j, i in enumerate(top_rows):
        n = min(params[i].top_n_tokens, width)
        top_ids_list[i] = [int(t) for t in flat[ids_start + j * width : ids_start + j * width + n]]
        top_logprobs_list[i] = flat[logprobs_start + j * width : logprobs_start + j * width + n]
    output = SamplerOutput(
        [int(t) for t in flat[:num_rows]], flat[num_rows : 2 * num_rows], top_ids_list, top_logprobs_list
    )
    return output, unchosen
