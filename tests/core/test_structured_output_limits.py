"""Grammar limits, the compile pool (time limit, cancellation, cache, forked workers), precompiled grammars in the
engine, the ``auto`` fallback when llguidance cannot read a tokenizer, and finish reason ``error`` when a grammar
allows no token (a word-level vocabulary that cannot spell the grammar's string)."""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import re

import pytest

from grammar_models import word_level_model
from pagedllm import LLM, ParamError, SamplingParams, StructuredOutputsParams
from pagedllm.commands.engine_args import add_engine_args, engine_config
from pagedllm.structured_output import (GRAMMAR_DEAD_END, GrammarLimitError, PrecompiledSpec, StructuredOutputsConfig,
                                        check_spec)
from pagedllm.structured_output.compile_pool import CompileTimeout, GrammarCompilePool
from server_utils import gone, tiny_chat_model

S = StructuredOutputsParams
CASELESS = S(regex="(?i)ab")  # xgrammar refuses the inline flag, llguidance takes it


def _nested(depth: int) -> dict:
    """A schema ``depth`` objects deep, built without recursion."""
    node: dict = {"type": "integer"}
    for _ in range(depth):
        node = {"type": "object", "properties": {"a": node}}
    return node


@pytest.mark.parametrize("spec, words", [
    (S(choice=["x"] * 11), ["number of choices 11", "limit of 10", "--structured-outputs-max-choices"]),
    (S(choice=["x" * 101] * 10), ["total length of the choices (characters) 1010", "limit of 1000",
                                  "--structured-outputs-max-grammar-chars"]),
    (S(regex="a" * 1001), ["regex's length (characters) 1001", "--structured-outputs-max-grammar-chars"]),
    (S(grammar="root ::= " + '"a" ' * 250), ["grammar's length", "--structured-outputs-max-grammar-chars"]),
    (S(json=_nested(5)), ["nesting depth 9", "limit of 8", "--structured-outputs-max-schema-depth"]),
    (S(json={"type": "object", "properties": {f"p{i}": {} for i in range(7)}}),
     ["more than 6 properties", "--structured-outputs-max-schema-properties"]),
    (S(json={"enum": ["x" * 1001]}), ["longer than 1000 characters", "--structured-outputs-max-grammar-chars"]),
])
def test_each_limit_names_itself_and_its_flag(spec, words):
    cfg = StructuredOutputsConfig(max_choices=10, max_grammar_chars=1000, max_schema_depth=8, max_schema_properties=6)
    with pytest.raises(GrammarLimitError) as e:
        check_spec(spec, cfg)
    assert e.value.field == f"structured_outputs.{spec.kind}"
    for w in words:
        assert w in e.value.message, e.value.message
    check_spec(spec, StructuredOutputsConfig())  # the defaults let these small specs through


def test_limit_check_never_recurses():
    """100,000 levels (far past Python's recursion limit): refused by depth, no RecursionError."""
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(GrammarLimitError, match="nesting depth 65"):
        check_spec(S(json={"type": "array", "items": {"enum": deep}}), StructuredOutputsConfig())


def test_config_from_json_and_flags():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--structured-outputs-config", '{"max_choices": 10, "compile_timeout": 2.5}',
                         "--structured-outputs-max-choices", "20", "--structured-outputs-compile-workers", "3"])
    cfg = engine_config(args).structured_outputs_config
    assert (cfg.max_choices, cfg.compile_timeout, cfg.compile_workers, cfg.max_schema_depth) == (20, 2.5, 3, 64)
    with pytest.raises(ParamError) as e:
        StructuredOutputsConfig.parse('{"max_choice": 3}')
    assert e.value.field == "structured_outputs_config.max_choice"
    with pytest.raises(ParamError, match="positive int"):
        StructuredOutputsConfig.parse({"max_choices": 0})
    with pytest.raises(ParamError, match="not valid JSON"):
        StructuredOutputsConfig.parse("{")


def test_offline_engine_applies_the_limits():
    llm = LLM(tiny_chat_model(), device="cpu", max_model_len=256, kv_cache_memory=16 << 20,
              structured_outputs_config={"max_choices": 3})
    with pytest.raises(GrammarLimitError, match="--structured-outputs-max-choices"):
        llm.generate(["x"], SamplingParams(structured_outputs=S(choice=list("abcd"))), use_tqdm=False)
    out = llm.generate(["x"], SamplingParams(max_tokens=5, structured_outputs=S(choice=list("abc"))),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in {"a", "b", "c"} and out.finish_reason == "stop"
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_chat_model())


def _run(coro):
    return asyncio.run(coro)


def test_compile_pool_time_limit_cancellation_cache_and_precompiled_load(tokenizer):
    """One pool, every path: a compile, a bad spec (ParamError), a cache hit (no worker), a compile past the
    time limit (its worker killed, a fresh one forked at once), a cancelled compile (killed too); and what the pool
    compiled is what the engine loads: the output follows the grammar."""
    cfg = StructuredOutputsConfig(compile_workers=1, compile_timeout=1.0)

    async def scenario():
        pool = GrammarCompilePool(tokenizer, len(tokenizer), [tokenizer.eos_token_id], "auto", cfg)
        await pool.start()
        try:
            backend, payload = await pool.compile(S(regex=r"[A-Z]{3}-\d{2}"), 300)  # waits for the zygote
            assert backend == "xgrammar" and payload
            with pytest.raises(ParamError) as e:
                await pool.compile(S(regex="[a-"), 30)
            assert e.value.field == "structured_outputs.regex"
            [first] = pool.pids
            assert await pool.compile(S(regex=r"[A-Z]{3}-\d{2}"), 30) == (backend, payload)  # cached
            big = S(choice=[f"option number {i}" for i in range(100_000)])  # ~10 s to compile here
            with pytest.raises(CompileTimeout):
                await pool.compile(big, 0.5)
            assert gone(first, 5)
            ok = await pool.compile(S(choice=["yes", "no"]), 60)  # the replacement, forked in milliseconds
            [second] = pool.pids
            assert second != first and ok[0] == "xgrammar"
            task = asyncio.ensure_future(pool.compile(S(choice=[f"other {i}" for i in range(100_000)]), 60))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert gone(second, 5) and pool.restarts == 2
            caseless = await pool.compile(CASELESS, 60)  # auto: llguidance's, precompiled
            assert caseless[0] == "guidance"
            return backend, payload, caseless
        finally:
            pool.shutdown()

    backend, payload, caseless = _run(scenario())
    llm = LLM(tiny_chat_model(), device="cpu", max_model_len=256, kv_cache_memory=16 << 20)
    spec = PrecompiledSpec.of(S(regex=r"[A-Z]{3}-\d{2}"), backend, payload)
    outs = llm.generate(["id:"], SamplingParams(temperature=1.0, n=4, seed=1, max_tokens=20, structured_outputs=spec),
                        use_tqdm=False)[0].outputs
    assert all(re.fullmatch(r"[A-Z]{3}-\d{2}", c.text) for c in outs), [c.text for c in outs]
    out = llm.generate(["x"], SamplingParams(max_tokens=8, n=4, temperature=1.0, seed=0,
                                             structured_outputs=PrecompiledSpec.of(CASELESS, *caseless)),
                       use_tqdm=False)
    assert all(re.fullmatch("(?i)ab", c.text) for c in out[0].outputs), [c.text for c in out[0].outputs]
    # A payload the engine cannot load (compiled for another vocabulary) is compiled in the engine instead.
    bad = PrecompiledSpec.of(S(choice=["left", "right"]), "xgrammar", "{}")
    out = llm.generate(["go"], SamplingParams(max_tokens=5, structured_outputs=bad), use_tqdm=False)[0].outputs[0]
    assert out.text in {"left", "right"}


def test_engine_cache_is_bounded_by_bytes():
    llm = LLM(tiny_chat_model(), device="cpu", max_model_len=256, kv_cache_memory=16 << 20)
    cache = llm.llm_engine.structured._cache

    def run(i: int) -> None:
        so = S(choice=[f"w{i}-{j}" for j in range(300)])
        llm.generate(["x"], SamplingParams(max_tokens=3, structured_outputs=so), use_tqdm=False)

    run(0)
    one = cache.nbytes()
    cache.max_bytes = int(2.5 * one)  # room for two of these grammars
    for i in range(1, 6):
        run(i)
    run(5)  # a lookup (cache hit) checks the bound with the newest grammar compiled
    assert len(cache) == 2 and cache.nbytes() <= cache.max_bytes, (len(cache), cache.nbytes(), one)


@pytest.fixture(scope="module")
def word_llm(tmp_path_factory):
    return LLM(word_level_model(tmp_path_factory.mktemp("wl") / "m"), device="cpu", max_model_len=64,
               kv_cache_memory=8 << 20)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_allowing_no_token_finishes_with_error(word_llm, temperature):
    """``maybe`` is not a word of the vocabulary: no token is allowed. The sample ends with finish reason ``error``
    and no token, rather than the off-grammar token the sampler picked."""
    params = SamplingParams(max_tokens=5, temperature=temperature, n=2, seed=0,
                            structured_outputs=S(choice=["maybe"]))
    for c in word_llm.generate(["one two"], params, use_tqdm=False)[0].outputs:
        assert (c.finish_reason, c.token_ids, c.text, c.stop_reason) == ("error", [], "", GRAMMAR_DEAD_END)
    ok = word_llm.generate(["one"], SamplingParams(max_tokens=5, temperature=temperature,
                                                   structured_outputs=S(choice=["yes", "maybe"])), use_tqdm=False)
    assert ok[0].outputs[0].text.strip() == "yes" and ok[0].outputs[0].finish_reason == "stop"
    # min_tokens forbids the end, the only token the grammar leaves after "yes": the same error, "yes" kept.
    late = word_llm.generate(["one"], SamplingParams(max_tokens=5, min_tokens=3, temperature=temperature,
                                                     structured_outputs=S(choice=["yes"])), use_tqdm=False)
    assert (late[0].outputs[0].token_ids, late[0].outputs[0].finish_reason) == ([3], "error")
    assert not word_llm.llm_engine.has_unfinished_requests() and word_llm.llm_engine.kv.num_used_blocks == 0


def test_auto_backend_reports_xgrammars_error_when_guidance_cannot_load(word_llm):
    """llguidance cannot read this tokenizer ("can't determine decoder type"); a grammar xgrammar refuses is a
    ParamError with xgrammar's reason, not the fallback's failure."""
    with pytest.raises(ParamError) as e:
        word_llm.generate(["x"], SamplingParams(structured_outputs=S(regex="(" * 3000 + "yes" + ")" * 3000)),
                          use_tqdm=False)
    assert e.value.field == "structured_outputs.regex" and "Nest layer" in e.value.message, e.value.message
    assert not word_llm.llm_engine.has_unfinished_requests()


def test_precompiled_spec_pickles_with_its_payload():
    """It crosses the server/engine pipe whole and keeps the spec's key (the engine's cache key)."""
    spec = PrecompiledSpec.of(S(json=json.dumps({"type": "integer"})), "xgrammar", "payload")
    back = pickle.loads(pickle.dumps(spec))
    assert back.key == S(json={"type": "integer"}).key and back.payload == "payload" and "payload" not in repr(back)


def test_worker_that_grew_past_its_memory_bound_is_replaced(tokenizer):
    """``worker_memory_bytes`` of 1: every worker grows past it with its first compile, answers, exits, and a fresh
    fork takes its place."""
    cfg = StructuredOutputsConfig(compile_workers=1, worker_memory_bytes=1)

    async def scenario():
        pool = GrammarCompilePool(tokenizer, len(tokenizer), [tokenizer.eos_token_id], "xgrammar", cfg)
        await pool.start()
        try:
            pids = []
            for i in range(3):
                while not pool.pids:  # the replacement is forked in the background
                    await asyncio.sleep(0.05)
                pids += pool.pids
                assert (await pool.compile(S(choice=[f"grow {i} {j}" for j in range(2000)]), 300))[0] == "xgrammar"
            return pids, pool.restarts
        finally:
            pool.shutdown()

    pids, restarts = _run(scenario())
    assert restarts == 3 and len(set(pids)) == 3, (pids, restarts)
