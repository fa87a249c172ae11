"""Reasoning parsers (pagedllm.reasoning) on scripted texts and token sequences.

The oracle for streaming is the parser's own whole-output split: for every way of cutting an output into deltas
(one character at a time, one token at a time, seeded random chunks, and every truncation point, so a tag is cut
across deltas and left half-written at the end), the concatenated reasoning and content deltas must equal
``extract_reasoning`` of the whole text exactly. The whole-text splits are checked against hand-written values
(vLLM's documented behaviour of each parser).
"""

from __future__ import annotations

import random

import pytest

from pagedllm.reasoning import (DeltaMessage, GptOssReasoningParser, ReasoningParser, ReasoningParserManager,
                                ReasoningStream, get_reasoning_parser)
from reasoning_models import reasoning_tokenizer


@pytest.fixture(scope="module")
def tok():
    return reasoning_tokenizer()


def parser(tok, name: str, **kw) -> ReasoningParser:
    return get_reasoning_parser(name, tok, **kw)


def streamed(p: ReasoningParser, chunks: list[str], prompt_ids=()) -> tuple[str, str]:
    st = ReasoningStream(p, prompt_ids)
    r = c = ""
    for ch in chunks:
        d = st.delta(ch)
        assert d is None or isinstance(d, DeltaMessage)
        if d is not None:
            assert d.reasoning or d.content, "an empty delta must be None"
            r += d.reasoning or ""
            c += d.content or ""
    d = st.finish()
    if d is not None:
        r += d.reasoning or ""
        c += d.content or ""
    return r, c


def chunkings(text: str, tok) -> list[list[str]]:
    ids = tok.encode(text, add_special_tokens=False)
    by_token = [tok.decode(ids[:i + 1], skip_special_tokens=False) for i in range(len(ids))]
    by_token = [b[len(a):] for a, b in zip([""] + by_token, by_token)]
    rng = random.Random(0)
    out = [list(text), by_token, [text]]
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 4))) if len(text) > 1 else []
        out.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    return out


def assert_stream_matches_whole(p: ReasoningParser, text: str, tok, prompt_ids=()) -> None:
    whole = ReasoningStream(p, prompt_ids).whole(text)
    expect = (whole[0] or "", whole[1] or "")
    for chunks in chunkings(text, tok):
        assert streamed(p, chunks, prompt_ids) == expect, (text, chunks)
    for cut in range(len(text)):  # every truncation: a tag half-written at the end of the output
        prefix = text[:cut]
        w = ReasoningStream(p, prompt_ids).whole(prefix)
        assert streamed(p, list(prefix), prompt_ids) == (w[0] or "", w[1] or ""), prefix


THINK_CASES = [
    # (text, deepseek_r1 split, qwen3 split)
    ("<think>I should greet</think>Hello there", ("I should greet", "Hello there"), ("I should greet", "Hello there")),
    ("\n<think>\nstep 1\n</think>\n\nAnswer: 4", ("\nstep 1\n", "\n\nAnswer: 4"), ("\nstep 1\n", "\n\nAnswer: 4")),
    ("I should greet</think>Hello there", ("I should greet", "Hello there"), ("I should greet", "Hello there")),
    ("<think>still thinking", ("still thinking", None), ("still thinking", None)),
    ("<think>a < b and </th", ("a < b and </th", None), ("a < b and </th", None)),
    ("<think>done</think>", ("done", None), ("done", None)),
    ("</think>only content", (None, "only content"), (None, "only content")),
    ("<thinking is not a tag", ("<thinking is not a tag", None), ("<thinking is not a tag", None)),
]


@pytest.mark.parametrize("case", range(len(THINK_CASES)))
@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_think_parsers_split(tok, name, case):
    text, r1, q3 = THINK_CASES[case]
    p = parser(tok, name)
    assert p.extract_reasoning(text, None) == (r1 if name == "deepseek_r1" else q3)
    assert_stream_matches_whole(p, text, tok)


def test_qwen3_without_thinking_is_all_content(tok):
    p = parser(tok, "qwen3", chat_template_kwargs={"enable_thinking": False})
    assert p.extract_reasoning("Plain reply", None) == (None, "Plain reply")
    assert p.extract_reasoning("<think>x</think>y", None) == ("x", "y")  # a model that thinks anyway
    assert_stream_matches_whole(p, "Plain reply", tok)
    # The server's rule (vLLM's prompt_is_reasoning_end): a prompt that closed the think block -> all content,
    # whatever the parser instance was told.
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                     enable_thinking=False, tokenize=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    default = parser(tok, "qwen3")
    assert default.is_reasoning_end(prompt_ids)
    assert ReasoningStream(default, prompt_ids).whole("Plain reply") == (None, "Plain reply")
    assert_stream_matches_whole(default, "Plain </think> reply", tok, prompt_ids)
    assert streamed(default, list("Plain </think> reply"), prompt_ids) == ("", "Plain </think> reply")


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_think_parsers_token_ids(tok, name):
    p = parser(tok, name)
    think, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    assert (p.start_token_id, p.end_token_id) == (think, end)
    words = tok.encode("I should greet", add_special_tokens=False)
    answer = tok.encode("Hello there", add_special_tokens=False)
    out = [think] + words + [end] + answer
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert not p.is_reasoning_end(prompt)
    assert not p.is_reasoning_end(prompt + [think])  # R1's template opens the tag in the prompt
    for i in range(len(out)):
        ids = prompt + out[:i + 1]
        ended = i >= 1 + len(words)
        assert p.is_reasoning_end(ids) == ended, i
        # Streaming form: only the step that emits </think> turns it on.
        assert p.is_reasoning_end_streaming(ids, out[i:i + 1]) == (out[i] == end), i
    assert p.extract_content_ids(out) == answer
    assert p.extract_content_ids(out[:-len(answer)]) == []
    assert p.extract_content_ids(out[:3]) == []
    assert p.count_reasoning_tokens(out) == len(words)
    # An earlier turn's closed block, then a new open one: still reasoning.
    assert not p.is_reasoning_end([think, 5, end, 6, think, 7])


def test_multi_token_tags_are_sequences():
    """A tokenizer without the tags as added tokens: they are matched as id sequences."""
    from transformers import AutoTokenizer

    from server_utils import tiny_chat_model

    plain = AutoTokenizer.from_pretrained(tiny_chat_model())
    p = get_reasoning_parser("deepseek_r1", plain)
    assert p.end_token_id is None and len(p.end_token_ids) > 1
    ids = plain.encode("<think>abc</think>xyz", add_special_tokens=False)
    assert p.is_reasoning_end(ids) and not p.is_reasoning_end(ids[:-len(plain.encode("xyz"))
                                                                      - len(p.end_token_ids) + 1])
    assert plain.decode(p.extract_content_ids(ids)) == "xyz"
    assert p.extract_reasoning(plain.decode(ids), None) == ("abc", "xyz")


HARMONY = "<|channel|>analysis<|message|>Weigh options<|end|><|start|>assistant<|channel|>final<|message|>Sure thing<|return|>"
HARMONY_CASES = [
    (HARMONY, ("Weigh options", "Sure thing")),
    ("<|channel|>final<|message|>Direct answer<|return|>", (None, "Direct answer")),
    ("<|channel|>analysis<|message|>Still going", ("Still going", None)),
    ("<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis<|message|>two<|end|>"
     "<|start|>assistant<|channel|>final<|message|>ans", ("one\ntwo", "ans")),
    ("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary<|message|>I'll look"
     "<|end|><|start|>assistant<|channel|>final <|constrain|>text<|message|>done<|return|>",
     ("think", "I'll look\ndone")),
    ("Plain text without harmony", (None, "Plain text without harmony")),
    ("<|notamarker|> text", (None, "<|notamarker|> text")),
]


@pytest.mark.parametrize("case", range(len(HARMONY_CASES)))
def test_gpt_oss_split(tok, case):
    text, expect = HARMONY_CASES[case]
    p = parser(tok, "gpt_oss")
    assert p.extract_reasoning(text, None) == expect
    assert_stream_matches_whole(p, text, tok)


def test_gpt_oss_token_ids(tok):
    p = parser(tok, "gpt_oss")
    assert ReasoningParserManager.get_reasoning_parser("openai_gptoss") is GptOssReasoningParser  # vLLM's name
    prompt = tok.encode("<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>Old"
                        "<|end|><|start|>user<|message|>again<|end|><|start|>assistant", add_special_tokens=False)
    out = tok.encode(HARMONY, add_special_tokens=False)
    assert not p.is_reasoning_end(prompt), "an earlier turn's final message does not end this turn's reasoning"
    final_at = len(tok.encode(HARMONY.split("Sure")[0], add_special_tokens=False))
    for i in range(len(out)):
        ids = prompt + out[:i + 1]
        assert p.is_reasoning_end(ids) == (i + 1 >= final_at), i
        assert p.is_reasoning_end_streaming(ids, out[i:i + 1]) == (i + 1 >= final_at), i
    assert tok.decode(p.extract_content_ids(out)) == "Sure thing<|return|>"
    # The split spelling of the markers (other token ids, same text) ends the reasoning too.
    split = tok.encode("<|start|> assistant", add_special_tokens=False) + [
        tok.convert_tokens_to_ids(t) for t in ("<|chan", "nel|>")] + tok.encode("final", add_special_tokens=False) + [
        tok.convert_tokens_to_ids(t) for t in ("<|mess", "age|>")]
    assert p.is_reasoning_end_streaming(prompt + out[:5] + split, split[-1:])


def test_gpt_oss_keeps_special_tokens(tok):
    class Req:
        skip_special_tokens = True

    req = parser(tok, "gpt_oss").adjust_request(Req())
    assert req.skip_special_tokens is False
    req = parser(tok, "qwen3").adjust_request(Req())
    assert req.skip_special_tokens is True


def test_registry(tok):
    assert {"deepseek_r1", "qwen3", "gpt_oss"} <= set(ReasoningParserManager.list_registered())
    with pytest.raises(KeyError, match="deepseek_r1"):
        ReasoningParserManager.get_reasoning_parser("nope")

    @ReasoningParserManager.register_module("test_custom")
    class Custom(ReasoningParser):
        def split(self, text, final):
            return text, ""

    try:
        assert get_reasoning_parser("test_custom", tok).extract_reasoning("x", None) == ("x", None)
        ReasoningParserManager.register_lazy_module("test_lazy", "pagedllm.reasoning.qwen3_reasoning_parser",
                                                    "Qwen3ReasoningParser")
        assert ReasoningParserManager.get_reasoning_parser("test_lazy").__name__ == "Qwen3ReasoningParser"
        with pytest.raises(TypeError):
            ReasoningParserManager.register_module("bad", module=int)
    finally:
        ReasoningParserManager.reasoning_parsers.pop("test_custom", None)
        ReasoningParserManager.reasoning_parsers.pop("test_lazy", None)
        ReasoningParserManager.lazy_parsers.pop("test_lazy", None)


# ---- the engine: a grammar applies to the answer after the reasoning (offline LLM, scripted model) -------------
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def scripted_model(tmp_path_factory):
    from reasoning_models import scripted_reasoning_model

    return scripted_reasoning_model(tmp_path_factory.mktemp("scripted") / "model")


def _chat(llm, sp, **kw) -> str:
    return llm.chat([{"role": "user", "content": "hi"}], sp, use_tqdm=False, **kw)[0].outputs[0].text


def test_grammar_waits_for_the_end_of_reasoning(scripted_model):
    import json

    import jsonschema

    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
    from reasoning_models import ANSWER, PLAIN, REASONING

    json_sp = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    free_sp = SamplingParams(temperature=0, max_tokens=40)
    with LLM(scripted_model, device="cpu", max_model_len=256,
             structured_outputs_config={"reasoning_parser": "qwen3"}) as llm:
        assert _chat(llm, free_sp) == f"<think>{REASONING}</think>{ANSWER}"  # the script, unconstrained
        assert _chat(llm, free_sp, chat_template_kwargs={"enable_thinking": False}) == PLAIN
        text = _chat(llm, json_sp)
        reasoning, content = get_reasoning_parser("qwen3", llm.get_tokenizer()).extract_reasoning(text, None)
        assert reasoning == REASONING  # free text while reasoning: the grammar was not applied
        jsonschema.validate(json.loads(content), SCHEMA)  # then it was: the script's "Hello there" is gone
        # enable_thinking=False: the prompt closes the think block, so the grammar applies from the first token
        no_think = _chat(llm, json_sp, chat_template_kwargs={"enable_thinking": False})
        jsonschema.validate(json.loads(no_think), SCHEMA)
        # n > 1: every sample gets its own gate
        out = llm.chat([{"role": "user", "content": "hi"}], json_sp.clone(n=2, best_of=2), use_tqdm=False)[0]
        assert [c.text for c in out.outputs] == [text, text]
    with LLM(scripted_model, device="cpu", max_model_len=256) as llm:  # no parser: the grammar applies at once
        text = _chat(llm, json_sp)
        jsonschema.validate(json.loads(text), SCHEMA)
    with LLM(scripted_model, device="cpu", max_model_len=256,
             structured_outputs_config={"reasoning_parser": "qwen3", "enable_in_reasoning": True}) as llm:
        assert _chat(llm, json_sp) == text  # vLLM's enable_in_reasoning: constrained all along


def test_unknown_reasoning_parser_is_refused():
    from pagedllm.errors import ParamError
    from pagedllm.structured_output import StructuredOutputsConfig

    with pytest.raises(ParamError, match="reasoning_parser.*nope.*deepseek_r1"):
        StructuredOutputsConfig.parse({"reasoning_parser": "nope"})
    with pytest.raises(ParamError, match="enable_in_reasoning"):
        StructuredOutputsConfig.parse({"enable_in_reasoning": "yes"})
