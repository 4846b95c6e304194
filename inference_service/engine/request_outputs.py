"""What a live request's sampled tokens become: its record (`LiveRequest`), the token appended with
its text, the finish reason (TGI's precedence), and the `RequestOutput`s released to the caller,
stop-sequence look-alikes held back; prompt logprobs recorded as the prefill runs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from inference_service.engine.detokenizer import TextState, decode, special_token_ids
from inference_service.engine.request import Request
from inference_service.outputs import EngineInfo, FinishReason, PrefillToken, RequestOutput, ScheduledRequest, Token
from inference_service.sample.sampler import SamplerOutput, SamplingState
from inference_service.sampling_params import EngineRequest


@dataclass
class LiveRequest:
    """The one record of a request the engine runs: the scheduler's `Request` (counters, status),
    what the caller asked (`spec`), its sampling state, its text and the tokens held back."""

    request: Request
    spec: EngineRequest
    sampling: SamplingState
    text: TextState
    pending: list[Token] = field(default_factory=list)  # held back: may be the start of a stop sequence
    pending_top: list[list[Token]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top: list[list[tuple[int, float]]] = field(default_factory=list)  # with top_n_tokens
    sent_prefill: bool = False


class RequestOutputs:
    """Turns sampled tokens into requests' outputs, with the tokenizer's text and the engine's limits."""

    def __init__(self, tokenizer, info: EngineInfo):
        self.tokenizer = tokenizer
        self.max_total_tokens = info.max_total_tokens
        self._eos_ids = frozenset(info.eos_token_ids)
        self._special_ids = special_token_ids(tokenizer) | self._eos_ids

    def take_token(self, live: LiveRequest, sampled: SamplerOutput, row: int) -> FinishReason | None:
        """Append the token to the request, its text and its pending output; whether it ends it."""
        request = live.request
        token_id = sampled.token_ids[row]
        request.output_token_ids.append(token_id)
        live.sampling.append(token_id)
        if request.timings.first_token is None:
            request.timings.first_token = time.perf_counter()
        special = self.is_special(token_id)
        added = live.text.add(token_id, special)
        live.pending.append(Token(token_id, added.text, sampled.logprobs[row], special))
        live.pending_top.append(
            [self.top_token(i, lp) for i, lp in zip(sampled.top_ids[row], sampled.top_logprobs[row], strict=True)]
        )
        grammar = live.sampling.grammar
        return self.finish_reason(request, token_id, added.stop_matched, grammar is not None and grammar.is_complete)

    def finish_reason(
        self, request: Request, token_id: int, stop_matched: bool, grammar_complete: bool
    ) -> FinishReason | None:
        """TGI's precedence: length, then EOS, then a stop sequence.

        A complete grammar (nothing but EOS allowed next) ends the request as if EOS had been
        sampled, without spending a step on it: what the model could still say is EOS alone.
        """
        if request.num_output_tokens >= request.stopping.max_new_tokens or request.num_tokens >= self.max_total_tokens:
            return FinishReason.LENGTH
        if grammar_complete or (token_id in self._eos_ids and not request.stopping.ignore_eos):
            return FinishReason.EOS_TOKEN
        if stop_matched:
            return FinishReason.STOP_SEQUENCE
        return None

    def release(self, live: LiveRequest, count: int) -> RequestOutput | None:
        if count <= 0 and live.sent_prefill:
            return None
        output = RequestOutput(
            request_id=live.request.request_id,
            tokens=live.pending[:count],
            top_tokens=live.pending_top[:count],
            num_generated_tokens=live.request.num_output_tokens,
            num_prompt_tokens=live.request.num_input_tokens,
        )
        del live.pending[:count], live.pending_top[:count]
        if not live.sent_prefill:
            live.sent_prefill = True
            if live.spec.sampling.prompt_logprobs:
                output.prefill_tokens = self.prefill_tokens(live)
        return output

    def record_prompt_logprobs(self, live: LiveRequest, item: ScheduledRequest, logits: torch.Tensor) -> None:
        """logits [n, V] predict positions start+1 .. start+n; keep those inside the prompt."""
        # Positions already recorded (before a preemption that restarted the prompt) are skipped.
        first = max(item.num_computed_tokens, len(live.prompt_logprobs))
        end = min(item.num_computed_tokens + item.num_new_tokens, live.request.num_prompt_tokens - 1)
        if end <= first:
            return
        targets = torch.tensor(live.request.prompt_token_ids[first + 1 : end + 1], device=logits.device)
        offset = first - item.num_computed_tokens
        logprobs = torch.log_softmax(logits[offset : end - item.num_computed_tokens], dim=-1)  # [m, V]
        live.prompt_logprobs.extend(logprobs.gather(1, targets[:, None]).squeeze(1).tolist())
        top_n = min(live.spec.sampling.top_n_tokens, logprobs.shape[-1])
        if top_n > 0:
            values, ids = logprobs.topk(top_n, dim=-1)
            live.prompt_top.extend(
                list(zip(row_ids, row_values, strict=True))
                for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
            )

    def prefill_tokens(self, live: LiveRequest) -> list[PrefillToken]:
        ids = live.request.prompt_token_ids
        logprobs = [None, *live.prompt_logprobs]
        tops = [[], *live.prompt_top]
        return [
            PrefillToken(i, self.token_text(i), lp, [self.top_token(t, tlp) for t, tlp in top])
            for i, lp, top in zip(ids, logprobs, tops + [[]] * (len(ids) - len(tops)), strict=False)
        ]

    def top_token(self, token_id: int, logprob: float) -> Token:
        return Token(token_id, self.token_text(token_id), logprob, self.is_special(token_id))

    def token_text(self, token_id: int) -> str:
        return decode(self.tokenizer, [token_id], skip_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids
