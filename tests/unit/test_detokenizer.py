"""Incremental detokenization, stop sequences and stream hold-back, on real trained tokenizers."""

from __future__ import annotations

import copy
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference_service.engine.detokenizer import (
    MAX_NUM_PENDING_TOKENS,
    NUM_CONTEXT_TOKENS,
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopChecker,
    TextState,
    _direct_backend,
    decode,
    special_token_ids,
)

SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
# Characters of 1 to 4 UTF-8 bytes; the byte-level tokenizer splits many of them across tokens.
TEXT_CHARS = list("ab c.\néü日本語東京世界Привет😀🎉👍🏽✨")
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def sp_tokenizer():
    """A SentencePiece-style tokenizer (as Llama 2, Mistral): "▁" for spaces, byte fallback for
    unknown characters, and a decoder that strips the first leading space of a text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    text = "the quick brown fox jumps over a lazy dog café naïve 日本語 東京 hello world"
    lines = [" ".join(rng.choices(text.split(), k=rng.randint(3, 10))) for _ in range(200)]
    specials = ["<unk>", "<s>", "</s>"]
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trained.train_from_iterator(
        lines, trainers.BpeTrainer(vocab_size=200, special_tokens=specials, show_progress=False)
    )
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=[tuple(m) for m in model["merges"]], unk_token="<unk>", byte_fallback=True)
    )
    backend.normalizer = trained.normalizer
    backend.pre_tokenizer = trained.pre_tokenizer
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(specials)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def run_detokenizer(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    return [detokenizer.step(token_id) for token_id in token_ids]


def decoded_after(tokenizer, prompt_ids: list[int], token_ids: list[int], skip_special_tokens: bool) -> str:
    """The text `token_ids` add after the prompt in a whole decode: the reference."""
    whole = decode(tokenizer, prompt_ids + token_ids, skip_special_tokens=skip_special_tokens)
    prompt = decode(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    assert whole.startswith(prompt)
    return whole[len(prompt) :]


def run_text_state(state: TextState, token_ids: list[int], specials: frozenset[int]) -> list[str]:
    return [state.add(token_id, token_id in specials).text for token_id in token_ids]


# --- special tokens ---------------------------------------------------------------------------


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decode_skips_transformers_wrapper_with_the_same_text(byte_tokenizer, sp_tokenizer, skip_special_tokens):
    """Both fast tokenizers take the direct route, and it gives what `tokenizer.decode` gives, on any
    ids (specials and byte pieces included)."""
    rng = random.Random(1)
    for tokenizer in (byte_tokenizer, sp_tokenizer):
        assert _direct_backend(tokenizer) is tokenizer._tokenizer
        specials = sorted(special_token_ids(tokenizer))
        for _ in range(300):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 8))] + rng.sample(specials, 1)
            rng.shuffle(ids)
            skip = skip_special_tokens
            expected = tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert decode(tokenizer, ids, skip_special_tokens=skip) == expected


def test_a_tokenizer_overriding_decode_keeps_its_own(byte_tokenizer):
    class Shouting(type(byte_tokenizer)):
        def decode(self, token_ids, **kwargs):
            return super().decode(token_ids, **kwargs).upper()

    shouting = copy.copy(byte_tokenizer)
    shouting.__class__ = Shouting
    assert _direct_backend(shouting) is None
    ids = encode(byte_tokenizer, "quiet words")
    assert decode(shouting, ids, skip_special_tokens=False) == "QUIET WORDS"


def test_special_token_ids_are_the_named_and_added_special_tokens(byte_tokenizer):
    specials = special_token_ids(byte_tokenizer)
    assert specials == {byte_tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    assert byte_tokenizer.convert_tokens_to_ids("<|tool|>") not in specials


def test_special_token_ids_are_exactly_what_a_skipping_decode_drops(byte_tokenizer):
    specials = special_token_ids(byte_tokenizer)
    for token_id in range(len(byte_tokenizer)):
        skipped = decode(byte_tokenizer, [token_id], skip_special_tokens=True) == ""
        assert skipped == (token_id in specials), token_id


# --- IncrementalDetokenizer -------------------------------------------------------------------


@PROPERTY
@given(text=st.text(alphabet=TEXT_CHARS, max_size=40))
def test_incremental_text_is_the_text_for_byte_level_tokens(byte_tokenizer, text):
    prompt_ids = byte_tokenizer.encode("Hello 日本")
    pieces = run_detokenizer(IncrementalDetokenizer(byte_tokenizer, prompt_ids), encode(byte_tokenizer, text))
    assert "".join(pieces) == text
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


@PROPERTY
@given(text=st.text(alphabet=TEXT_CHARS + ["Ω", "ß", "€"], max_size=40))
def test_incremental_text_is_the_whole_decode_for_sentencepiece_tokens(sp_tokenizer, text):
    prompt_ids = sp_tokenizer.encode("hello world")
    token_ids = encode(sp_tokenizer, text)
    pieces = run_detokenizer(IncrementalDetokenizer(sp_tokenizer, prompt_ids), token_ids)
    assert "".join(pieces) == decoded_after(sp_tokenizer, prompt_ids, token_ids, skip_special_tokens=False)
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


@PROPERTY
@given(data=st.data())
def test_any_token_sequence_streams_a_prefix_of_the_whole_decode(byte_tokenizer, data):
    # Arbitrary generated ids: invalid UTF-8 and special tokens included; fewer than the pending
    # bound. A prompt is always encoded text.
    prompt_ids = byte_tokenizer.encode(data.draw(st.text(alphabet=TEXT_CHARS, max_size=8)))
    vocab = st.integers(0, len(byte_tokenizer) - 1)
    token_ids = data.draw(st.lists(vocab, max_size=MAX_NUM_PENDING_TOKENS - 1))
    detokenizer = IncrementalDetokenizer(byte_tokenizer, prompt_ids)
    streamed = "".join(run_detokenizer(detokenizer, token_ids))
    held = detokenizer.flush()
    assert streamed + held == decoded_after(byte_tokenizer, prompt_ids, token_ids, skip_special_tokens=False)
    assert held == "" or held.endswith(REPLACEMENT_CHAR)


def test_a_split_character_comes_with_its_last_token(byte_tokenizer):
    token_ids = encode(byte_tokenizer, "a👍🏽")
    pieces = run_detokenizer(IncrementalDetokenizer(byte_tokenizer, [0]), token_ids)
    assert len(token_ids) > 3  # several tokens per emoji: the case under test
    assert pieces[0] == "a"
    assert pieces[-1].endswith("🏽") and "".join(pieces) == "a👍🏽"
    assert "" in pieces


def test_special_tokens_stream_with_their_text(byte_tokenizer):
    eos = byte_tokenizer.eos_token_id
    token_ids = encode(byte_tokenizer, "the") + [eos]
    pieces = run_detokenizer(IncrementalDetokenizer(byte_tokenizer, [0]), token_ids)
    assert pieces[-1] == "<|endoftext|>"


def test_the_window_stays_short_however_long_the_text(byte_tokenizer):
    lengths: list[int] = []

    class RecordingTokenizer:  # the real tokenizer, recording how many ids each decode gets
        def decode(self, token_ids, **kwargs):
            lengths.append(len(token_ids))
            return byte_tokenizer.decode(token_ids, **kwargs)

    text = " ".join(["the quick brown fox 日本語 😀 Привет"] * 40)
    token_ids = encode(byte_tokenizer, text)
    pieces = run_detokenizer(IncrementalDetokenizer(RecordingTokenizer(), list(range(20))), token_ids)
    assert "".join(pieces) == text and len(token_ids) > 500
    assert max(lengths) <= NUM_CONTEXT_TOKENS + 8


def test_a_run_of_invalid_bytes_is_released_at_the_pending_bound(byte_tokenizer):
    lead_byte = byte_tokenizer.convert_tokens_to_ids("ð")  # byte 0xF0 alone: never completes
    detokenizer = IncrementalDetokenizer(byte_tokenizer, [0])
    pieces = run_detokenizer(detokenizer, [lead_byte] * MAX_NUM_PENDING_TOKENS)
    assert pieces[:-1] == [""] * (MAX_NUM_PENDING_TOKENS - 1)
    assert pieces[-1] == REPLACEMENT_CHAR * MAX_NUM_PENDING_TOKENS
    assert detokenizer.num_window_tokens == 0
    assert detokenizer.step(encode(byte_tokenizer, "x")[0]) == "x"


def test_flush_shows_a_cut_character_as_the_whole_decode_does(byte_tokenizer):
    first_token = encode(byte_tokenizer, "😀")[0]
    detokenizer = IncrementalDetokenizer(byte_tokenizer, [0])
    assert detokenizer.step(first_token) == ""
    assert detokenizer.flush() == REPLACEMENT_CHAR


# --- StopChecker ------------------------------------------------------------------------------


def test_stop_sequence_across_pieces():
    checker = StopChecker(["world"])
    assert checker.feed("hel") is None and checker.num_held_chars == 0
    assert checker.feed("lo wo") is None and checker.num_held_chars == 2
    assert checker.feed("rld!") == 3
    assert checker.matched_stop == "world" and checker.num_held_chars == 0


def test_stop_sequence_ending_inside_a_piece():
    checker = StopChecker(["ab"])
    assert checker.feed("xaby") == 3


def test_overlapping_prefixes_are_tracked():
    checker = StopChecker(["aab"])
    assert checker.feed("aa") is None and checker.num_held_chars == 2
    assert checker.feed("a") is None and checker.num_held_chars == 2
    assert checker.feed("b") == 1


def test_the_longest_of_stops_ending_together_is_reported():
    checker = StopChecker(["b", "ab"])
    assert checker.feed("xab") == 3 and checker.matched_stop == "ab"


def test_empty_and_repeated_stop_sequences_are_ignored():
    assert StopChecker([""]).feed("abc") is None
    assert StopChecker(["", "c", "c"]).feed("abc") == 3


def test_feeding_after_a_match_is_an_error():
    checker = StopChecker(["a"])
    checker.feed("a")
    with pytest.raises(RuntimeError):
        checker.feed("b")


def longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    """Brute force: the longest tail of `text` that is a proper prefix of some stop."""
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


def first_match_end(text: str, stops: list[str]) -> int | None:
    ends = [text.find(stop) + len(stop) for stop in stops if stop in text]
    return min(ends, default=None)


@PROPERTY
@given(
    stops=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=3),
    pieces=st.lists(st.text("abc", max_size=4), max_size=12),
)
def test_stop_checker_agrees_with_brute_force(stops, pieces):
    checker = StopChecker(stops)
    text = ""
    for piece in pieces:
        num_kept = checker.feed(piece)
        expected_end = first_match_end(text + piece, stops)
        if expected_end is not None:
            assert num_kept is not None and len(text) + num_kept == expected_end
            return
        assert num_kept is None
        text += piece
        assert checker.num_held_chars == longest_stop_prefix_suffix(text, stops)


# --- TextState --------------------------------------------------------------------------------


@PROPERTY
@given(data=st.data())
def test_streamed_text_concatenates_to_the_final_text(byte_tokenizer, data):
    specials = special_token_ids(byte_tokenizer)
    text = data.draw(st.text(alphabet=TEXT_CHARS, max_size=40))
    token_ids = encode(byte_tokenizer, text)
    for _ in range(data.draw(st.integers(0, 3))):  # special tokens anywhere, even inside a character
        position = data.draw(st.integers(0, len(token_ids)))
        token_ids.insert(position, data.draw(st.sampled_from(sorted(specials))))
    state = TextState(byte_tokenizer, byte_tokenizer.encode("Hi <|im_end|>"))
    pieces = run_text_state(state, token_ids, specials)
    streamed = "".join(p for p, t in zip(pieces, token_ids, strict=True) if t not in specials)
    assert streamed == state.final_text() == text
    assert state.final_text() == decode(byte_tokenizer, token_ids, skip_special_tokens=True)
    for piece, token_id in zip(pieces, token_ids, strict=True):
        assert REPLACEMENT_CHAR not in piece
        if token_id in specials:
            assert piece == byte_tokenizer.convert_ids_to_tokens(token_id)
    assert state.num_releasable_tokens() == len(token_ids)  # no stop sequence: nothing held


@PROPERTY
@given(text=st.text(alphabet=TEXT_CHARS, max_size=40))
def test_streamed_text_concatenates_to_the_final_text_sentencepiece(sp_tokenizer, text):
    prompt_ids = sp_tokenizer.encode("hello")
    token_ids = encode(sp_tokenizer, text)
    state = TextState(sp_tokenizer, prompt_ids)
    pieces = run_text_state(state, token_ids, special_token_ids(sp_tokenizer))
    assert "".join(pieces) == state.final_text()
    assert state.final_text() == decoded_after(sp_tokenizer, prompt_ids, token_ids, skip_special_tokens=True)


def stop_run(tokenizer, text: str, stops: list[str]) -> tuple[TextState, list[str], list[int]]:
    """Feed `text`'s tokens until a stop matches; returns the state, the pieces, the ids fed."""
    state = TextState(tokenizer, tokenizer.encode("Hi"), stops)
    pieces: list[str] = []
    token_ids = encode(tokenizer, text)
    for token_id in token_ids:
        pieces.append(state.add(token_id, False).text)
        if state.matched_stop is not None:
            break
    return state, pieces, token_ids[: len(pieces)]


def test_a_stop_sequence_spanning_tokens_ends_the_text_right_after_it(byte_tokenizer):
    state, pieces, token_ids = stop_run(byte_tokenizer, "the quick brown fox jumps", ["brown fo"])
    assert len(pieces) > 2 and state.matched_stop == "brown fo"
    assert "".join(pieces) == state.final_text() == "the quick brown fo"
    assert state.final_text(strip_stop=True) == "the quick "
    assert state.num_releasable_tokens() == len(token_ids)


def test_a_stop_sequence_ending_inside_a_token_cuts_that_token(byte_tokenizer):
    assert byte_tokenizer.convert_ids_to_tokens(encode(byte_tokenizer, "quick")) == ["quick"]
    state, pieces, _ = stop_run(byte_tokenizer, "the quick fox", ["qui"])
    assert pieces[-1] == "qui" and state.final_text() == "the qui"


def test_a_stop_sequence_inside_split_characters(byte_tokenizer):
    state, pieces, _ = stop_run(byte_tokenizer, "x 日本語東京 y", ["本語東"])
    assert "".join(pieces) == state.final_text() == "x 日本語東"


def test_add_after_a_stop_is_an_error(byte_tokenizer):
    state, _, _ = stop_run(byte_tokenizer, "the fox", ["fox"])
    with pytest.raises(RuntimeError):
        state.add(encode(byte_tokenizer, "x")[0], False)


def expected_releasable(token_ends: list[int], text: str, stops: list[str], matched: bool) -> int:
    """Brute force: tokens whose text ends before the tail that may still become a stop."""
    safe_end = len(text) - (0 if matched else longest_stop_prefix_suffix(text, stops))
    return sum(end <= safe_end for end in token_ends)


@PROPERTY
@given(
    text=st.text(alphabet=list("ab c日"), max_size=30),
    stops=st.lists(st.text(alphabet=list("ab c日"), min_size=1, max_size=4), max_size=3),
)
def test_hold_back_releases_exactly_when_no_stop_can_start_there(byte_tokenizer, text, stops):
    state = TextState(byte_tokenizer, [0], stops)
    token_ends: list[int] = []
    released: list[int] = []  # text end of the released tokens after each step
    for token_id in encode(byte_tokenizer, text):
        state.add(token_id, False)
        token_ends.append(len(state.final_text()))
        num_releasable = state.num_releasable_tokens()
        expected = expected_releasable(token_ends, state.final_text(), stops, state.matched_stop is not None)
        assert num_releasable == expected
        released.append(token_ends[num_releasable - 1] if num_releasable else 0)
        if state.matched_stop is not None:
            break
    if state.matched_stop is not None:  # nothing of the stop string was shown before it matched
        stop_start = len(state.final_text()) - len(state.matched_stop)
        assert all(end <= stop_start for end in released[:-1])


def test_a_held_token_is_released_once_the_text_departs_from_the_stop(byte_tokenizer):
    state = TextState(byte_tokenizer, [0], ["brown fox"])
    token_ids = encode(byte_tokenizer, "the quick brown cat")
    for token_id in token_ids[:-1]:
        state.add(token_id, False)
    assert state.final_text() == "the quick brown ca"
    assert state.num_releasable_tokens() == len(token_ids) - 1  # " ca" is not "brown fox"
    state = TextState(byte_tokenizer, [0], ["brown fox"])
    for token_id in encode(byte_tokenizer, "the quick brown f"):
        state.add(token_id, False)
    held = state.num_tokens - state.num_releasable_tokens()
    assert held >= 2  # the tokens of "brown f" wait
    state.add(encode(byte_tokenizer, "a")[0], False)
    assert state.num_releasable_tokens() == state.num_tokens


def test_a_special_token_after_a_pending_stop_prefix_waits_with_it(byte_tokenizer):
    im_end = byte_tokenizer.convert_tokens_to_ids("<|im_end|>")
    state = TextState(byte_tokenizer, [0], ["quick"])
    for token_id in encode(byte_tokenizer, "the q"):
        state.add(token_id, False)
    assert state.add(im_end, True).text == "<|im_end|>"
    assert state.num_releasable_tokens() == state.num_tokens - 2
    state.add(encode(byte_tokenizer, "x")[0], False)
    assert state.num_releasable_tokens() == state.num_tokens
    assert state.final_text() == "the qx"


def test_no_pending_stop_prefix_means_no_delay(byte_tokenizer):
    state = TextState(byte_tokenizer, [0], ["zzz"])
    for count, token_id in enumerate(encode(byte_tokenizer, "the quick brown fox 日本語"), start=1):
        state.add(token_id, False)
        assert state.num_releasable_tokens() == count


def test_a_character_cut_by_the_end_of_generation_is_left_out(byte_tokenizer):
    state = TextState(byte_tokenizer, [0])
    pieces = run_text_state(state, encode(byte_tokenizer, "ab😀")[:-1], frozenset())
    assert "".join(pieces) == state.final_text() == "ab"
