"""Encoder-decoders (T5, mT5, UMT5, BART, mBART, M2M100, Marian, Pegasus) run through the fallback
runner: the encoder once per request, the decoder with transformers' caches, decode rows of requests
in step batched together. Per family, on a tiny random config: greedy output equals transformers'
`generate` (staggered arrivals, mixed lengths, truncation, guesses, preemption), logprobs equal
`log_softmax` of `generate`'s logits within 1e-4, seeded sampling does not depend on batch neighbours,
a cancelled stream leaves no block and no cache, and forced first tokens (per request or from the
generation config) and BART's forced last EOS behave as in `generate`."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig, SchedulerConfig
from inference_service.engine.async_engine import STEP_DELAY_ENV, AsyncEngine
from inference_service.errors import ValidationError
from tests.engine_calls import generate, idle, seeded_alone_and_among_others
from tests.tiny_seq2seq import FAMILIES, save_model, seq2seq_config

PROMPTS = [
    ("the quick brown fox", 12),
    ("a", 20),
    ("jumps over the lazy dog and runs home", 7),
    ("café naïve", 16),
    ("the quick brown fox", 9),
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory, byte_tokenizer):
    config = seq2seq_config(request.param, byte_tokenizer)
    return save_model(config, byte_tokenizer, tmp_path_factory.mktemp(request.param))


def _engine(folder, speculate: int = 0, total_tokens: int = 2048) -> AsyncEngine:
    return AsyncEngine.from_config(
        EngineConfig(
            model=ModelConfig(model_id=str(folder)),
            cache=CacheConfig(block_size=4, max_batch_total_tokens=total_tokens),
            scheduler=SchedulerConfig(max_batch_prefill_tokens=8, speculate=speculate),
            limits=LimitsConfig(max_total_tokens=64),
        )
    )


async def _served(folder, calls, **engine_options):
    """Run `calls(engine)` on a started engine; its results and the idle stats after."""
    engine = _engine(folder, **engine_options)
    engine.start()
    try:
        results = await calls(engine)
        stats = await idle(engine)
        runner = engine._engine.runner
        num_batched, num_caches = runner.num_batched_rows, runner.num_caches
    finally:
        await engine.shutdown(timeout_s=1)
    assert stats.num_free_blocks == stats.num_total_blocks and num_caches == 0
    return results, stats, num_batched


def check_against_transformers(reference, request, result, **generate_options):
    """Tokens equal greedy `generate`'s, and each logprob is log_softmax of the logits `generate`
    computed for that position."""
    with torch.inference_mode():
        out = reference.generate(
            torch.tensor([request.prompt_token_ids]),
            do_sample=False,
            num_beams=1,
            max_new_tokens=request.stopping.max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            **generate_options,
        )
    tokens = [t.id for t in result.tokens]
    assert tokens == out.sequences[0, 1:].tolist(), request.prompt_token_ids
    expected = [
        torch.log_softmax(logits[0].float(), dim=-1)[t].item() for logits, t in zip(out.logits, tokens, strict=True)
    ]
    assert [t.logprob for t in result.tokens] == pytest.approx(expected, abs=1e-4)


async def test_greedy_and_logprobs_equal_transformers(family_dir, monkeypatch):
    reference = AutoModelForSeq2SeqLM.from_pretrained(family_dir, dtype=torch.float32).eval()
    # Steps of at least 20 ms: requests sent 10 ms apart overlap even where a busy machine would let a
    # tiny model's request finish before the next one is added (no batched rows to assert on).
    monkeypatch.setenv(STEP_DELAY_ENV, "20")

    async def calls(engine):
        info = engine.info
        assert (info.attention_impl, info.pipeline_tag, info.prefix_caching) == (
            "transformers",
            "text2text-generation",
            False,
        )

        async def one(index: int):
            await asyncio.sleep(0.01 * (index // 2))  # pairs arrive together, later ones join a running batch
            return await generate(engine, *PROMPTS[index], truncate=5 if index == 2 else None)

        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    for speculate in (0, 3):
        results, _stats, num_batched = await _served(family_dir, calls, speculate=speculate)
        if not speculate:
            assert num_batched > 0  # decode rows of requests admitted together ran as one forward
        assert len(results[2][0].prompt_token_ids) == 5  # truncate cuts the encoder's input
        for request, result in results:
            check_against_transformers(reference, request, result)


async def test_preempted_requests_recompute_their_encoder_and_finish_alike(family_dir):
    reference = AutoModelForSeq2SeqLM.from_pretrained(family_dir, dtype=torch.float32).eval()

    async def calls(engine):
        return await asyncio.gather(*(generate(engine, prompt, 20) for prompt, _ in PROMPTS))

    # 16 blocks of 4 decoder tokens: five requests of up to 21 tokens can't all stay.
    results, stats, _ = await _served(family_dir, calls, total_tokens=64)
    assert stats.num_preemptions > 0
    for request, result in results:
        check_against_transformers(reference, request, result)


async def test_seeded_sampling_ignores_its_neighbours_and_cancel_leaves_nothing(family_dir):
    (alone, together), _stats, _ = await _served(family_dir, seeded_alone_and_among_others)
    assert together == alone


async def test_prompt_details_are_the_decoder_start_and_full_text_prepends_the_input(family_dir):
    async def calls(engine):
        return await generate(engine, "the quick brown fox", 4, decoder_input_details=True, return_full_text=True)

    (request, result), _stats, _ = await _served(family_dir, calls)
    config = AutoConfig.from_pretrained(family_dir)
    # As TGI's seq2seq models: the decoder's input is the prefill, with no logprob for its first token.
    assert [(t.id, t.logprob) for t in result.prefill_tokens] == [(config.decoder_start_token_id, None)]
    assert result.generated_text.startswith("the quick brown fox")
    assert result.num_prompt_tokens == len(request.prompt_token_ids) > 1  # usage counts the encoder's input


@pytest.mark.parametrize("family", ["m2m_100", "mbart"])
async def test_forced_first_token_per_request_and_from_the_generation_config(family, tmp_path, byte_tokenizer):
    """M2M100/mBART name the target language by forcing the first generated token: the model's
    generation config gives a default, a request's `forced_bos_token` overrides it."""
    language = byte_tokenizer.convert_tokens_to_ids("<|im_start|>")
    other = byte_tokenizer.convert_tokens_to_ids("<|im_end|>")
    folder = save_model(seq2seq_config(family, byte_tokenizer), byte_tokenizer, tmp_path, forced_bos_token_id=language)
    reference = AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert reference.generation_config.forced_bos_token_id == language

    async def calls(engine):
        default = await generate(engine, "the quick brown fox", 8)
        chosen = await generate(engine, "the quick brown fox", 8, forced_bos_token="<|im_end|>")
        with pytest.raises(ValidationError, match="forced_bos_token"):
            await generate(engine, "the quick brown fox", 8, forced_bos_token="not-a-token")
        return default, chosen

    (default, chosen), _stats, _ = await _served(folder, calls)
    check_against_transformers(reference, *default)
    assert default[1].tokens[0].id == language
    assert chosen[1].tokens[0].id == other
    with torch.inference_mode():
        out = reference.generate(
            torch.tensor([chosen[0].prompt_token_ids]), do_sample=False, max_new_tokens=8, forced_bos_token_id=other
        )
    assert [t.id for t in chosen[1].tokens] == out[0, 1:].tolist()


async def test_bart_forces_eos_as_the_last_token_as_generate_does(tmp_path, byte_tokenizer):
    folder = save_model(seq2seq_config("bart", byte_tokenizer), byte_tokenizer, tmp_path)
    reference = AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.float32).eval()
    forced_eos = reference.generation_config.forced_eos_token_id
    assert forced_eos is not None  # BART's default

    async def calls(engine):
        return await generate(engine, "jumps over the lazy dog", 6)

    (request, result), _stats, _ = await _served(folder, calls)
    assert [t.id for t in result.tokens].index(forced_eos) == len(result.tokens) - 1
    check_against_transformers(reference, request, result)
