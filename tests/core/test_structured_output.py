"""Structured outputs offline: JSON schema, regex, choice, EBNF and Lark grammars on the tiny random model and on
SmolLM2, both grammar backends, greedy parity with HF + xgrammar's own logits processor, and composition with n>1,
preemption, prefix caching, stop strings and delta streaming."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from pagedllm import LLM, ParamError, SamplingParams, StructuredOutputsParams
from pagedllm.backend import ref_ops
from server_utils import tiny_chat_model
from structured_schemas import SCHEMAS, SMALL_SCHEMAS


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_chat_model(), device="cpu", max_model_len=512, kv_cache_memory=64 << 20)


def _json_params(schema: dict, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 200), structured_outputs=StructuredOutputsParams(json=schema),
                          **kw)


def _validate_all(outputs, schema) -> int:
    n = 0
    for o in outputs:
        for c in o.outputs:
            assert c.finish_reason == "stop", repr(c.text)
            jsonschema.validate(json.loads(c.text), schema)
            n += 1
    return n


def test_200_json_schema_generations_tiny_model(llm):
    """4 schemas x 50 samples (temperature 1), batched: every one parses and validates."""
    n = 0
    for i, schema in enumerate(SCHEMAS):
        outs = llm.generate([f"Record {i}:"] * 5, _json_params(schema, temperature=1.0, n=10), use_tqdm=False)
        n += _validate_all(outs, schema)
    assert n == 200


@pytest.mark.slow
def test_200_json_schema_generations_smollm2():
    """The real model, 200 samples in one batch (50 per schema, temperature 1): all parse and validate."""
    smol = LLM(None, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=512 << 20, max_num_seqs=200)
    prompts, params = [], []
    for i, schema in enumerate(SMALL_SCHEMAS):
        prompts += [f"JSON record {i}:"] * 5
        params += [_json_params(schema, temperature=1.0, n=10, max_tokens=120)] * 5
    outs = smol.generate(prompts, params, use_tqdm=False)
    assert sum(_validate_all(outs[5 * i:5 * i + 5], s) for i, s in enumerate(SMALL_SCHEMAS)) == 200


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_regex_choice_ebnf_lark_per_backend(backend, tiny_chat_engine_factory):
    llm = tiny_chat_engine_factory(backend)
    sp = lambda **so: SamplingParams(temperature=1.0, n=4, seed=7, max_tokens=40,  # noqa: E731
                                     structured_outputs=StructuredOutputsParams(**so))
    out = llm.generate(["id:"], sp(regex=r"[A-Z]{3}-\d{2,4}"), use_tqdm=False)[0]
    assert all(re.fullmatch(r"[A-Z]{3}-\d{2,4}", c.text) for c in out.outputs), [c.text for c in out.outputs]
    out = llm.generate(["pick:"], sp(choice=["alpha", "beta gamma", "δ"]), use_tqdm=False)[0]
    assert {c.text for c in out.outputs} <= {"alpha", "beta gamma", "δ"}
    out = llm.generate(["math:"], sp(grammar='root ::= num " + " num\nnum ::= [1-9] [0-9]?'), use_tqdm=False)[0]
    assert all(re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]?", c.text) for c in out.outputs), [c.text for c in out.outputs]
    out = llm.generate(["yn:"], sp(grammar='start: ("yes" | "no") "!"'), use_tqdm=False)[0]
    assert {c.text for c in out.outputs} <= {"yes!", "no!"}
    schema = SCHEMAS[2]
    out = llm.generate(["rec:"], _json_params(schema, temperature=1.0, n=4, seed=3), use_tqdm=False)
    assert _validate_all(out, schema) == 4


@pytest.fixture(scope="module")
def tiny_chat_engine_factory(llm):
    made = {"xgrammar": None, "guidance": None}

    def get(backend: str) -> LLM:
        if made[backend] is None:
            made[backend] = LLM(tiny_chat_model(), device="cpu", max_model_len=512, kv_cache_memory=32 << 20,
                                structured_outputs_backend=backend)
        return made[backend]

    return get


def test_greedy_matches_hf_with_xgrammar_logits_processor(llm):
    """The oracle: HF generate + xgrammar's HF logits processor, greedy, token for token."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from xgrammar.contrib.hf import LogitsProcessor

    path = tiny_chat_model()
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size)
    compiler = xgr.GrammarCompiler(info)
    prompt = tok.encode("Record:")
    for schema in SCHEMAS[:2]:
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        with torch.inference_mode():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=120, do_sample=False,
                              logits_processor=[LogitsProcessor(compiled)], pad_token_id=tok.eos_token_id)
        want = [t for t in ids[0, len(prompt):].tolist() if t != tok.eos_token_id]
        got = llm.generate({"prompt_token_ids": prompt}, _json_params(schema, temperature=0, max_tokens=120),
                           use_tqdm=False)[0].outputs[0]
        assert [t for t in got.token_ids if t != tok.eos_token_id] == want
        jsonschema.validate(json.loads(got.text), schema)


def test_bitmask_reference_matches_xgrammar_kernel():
    """core's torch reference vs xgrammar's CPU kernel, with the mask narrower and wider than the logits."""
    import xgrammar as xgr

    g = torch.Generator().manual_seed(0)
    for vocab, mask_vocab in ((1000, 1000), (1000, 960), (1000, 1030), (33, 64)):
        bitmask = torch.randint(-2**31, 2**31 - 1, (3, (mask_vocab + 31) // 32), generator=g, dtype=torch.int64
                                ).to(torch.int32)
        logits = torch.randn(3, vocab, generator=g)
        want = logits.clone()
        xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=min(vocab, mask_vocab))
        if mask_vocab < vocab:
            want[:, mask_vocab:] = float("-inf")  # tokens past the tokenizer's vocab are never allowed
        got = logits.clone()
        ref_ops.apply_token_bitmask(got, bitmask)
        assert torch.equal(got, want)


def test_composes_with_preemption_prefix_cache_stop_and_deltas():
    """A KV pool too small for the batch forces recompute preemption; matchers keep their state across it."""
    small = LLM(tiny_chat_model(), device="cpu", max_model_len=256, num_gpu_blocks_override=24, block_size=16,
                enable_prefix_caching=True)
    schema = SCHEMAS[0]
    prompt = "A long shared prefix for the prefix cache. " * 3
    outs = small.generate([prompt] * 12, _json_params(schema, temperature=1.0, seed=11), use_tqdm=False)
    assert _validate_all(outs, schema) == 12
    st = small.llm_engine.get_stats()
    assert st.num_preemptions > 0 and st.prefix_hits > 0
    # stop strings end a constrained output early (the grammar never forces past them)
    out = small.generate([prompt], SamplingParams(temperature=0, max_tokens=100, stop=['"age"'],
                                                   structured_outputs=StructuredOutputsParams(json=schema)),
                         use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == '"age"' and out.text.startswith('{"name": "')
    # delta outputs (streaming) concatenate to the same text as the final output
    eng = small.llm_engine
    eng.add_request("d", prompt, _json_params(schema, temperature=0, output_kind="delta"))
    text = ""
    while eng.has_unfinished_requests():
        for o in eng.step():
            text += o.outputs[0].text
    full = small.generate([prompt], _json_params(schema, temperature=0), use_tqdm=False)[0].outputs[0].text
    assert text == full
    jsonschema.validate(json.loads(text), schema)


def test_compile_runs_off_the_step_loop(llm):
    """While a grammar compiles, unconstrained requests keep stepping; the constrained one waits, then runs."""
    eng = llm.llm_engine
    gate = threading.Event()
    eng.structured._pool.submit(gate.wait)  # occupy the compile thread
    schema = {"type": "object", "properties": {"k": {"enum": ["compile-gate-test"]}}, "required": ["k"]}
    eng.add_request("grammar", "x", _json_params(schema, temperature=0))
    eng.add_request("plain", "x", SamplingParams(max_tokens=3, temperature=0))
    finished = {}
    for _ in range(6):
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
    assert "plain" in finished and "grammar" not in finished
    assert any(r.request_id == "grammar" for r in eng.scheduler.waiting)
    gate.set()
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
    assert json.loads(finished["grammar"].outputs[0].text) == {"k": "compile-gate-test"}


@pytest.mark.parametrize("so, field", [
    (dict(regex="[a-"), "structured_outputs.regex"),
    (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "structured_outputs.json"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
])
def test_uncompilable_grammar_raises_naming_it(llm, so, field):
    with pytest.raises(ParamError) as e:
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**so)), use_tqdm=False)
    assert e.value.field == field
    assert not llm.llm_engine.has_unfinished_requests() and llm.llm_engine.kv.num_used_blocks == 0


def test_spec_validation():
    with pytest.raises(ParamError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ParamError) as e:
        StructuredOutputsParams(json="{not json")
    assert e.value.field == "structured_outputs.json"
    with pytest.raises(ParamError) as e:
        StructuredOutputsParams(choice=[])
    assert e.value.field == "structured_outputs.choice"


def test_mixed_batch_masks_only_constrained_rows(llm):
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = llm.generate(["Hello there"], plain, use_tqdm=False)[0].outputs[0].token_ids
    schema = SCHEMAS[0]
    outs = llm.generate(["Hello there", "rec:", "Hello there"], [plain, _json_params(schema, temperature=0), plain],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone == outs[2].outputs[0].token_ids
    _validate_all(outs[1:2], schema)


def test_grammar_row_beside_speculative_rows(llm):
    """A grammar request admitted while others speculate (n-gram): its prefill row follows their speculative rows,
    so its mask must land on its own logits row, not on its index among the sampling requests; the speculating
    requests still produce plain decoding's tokens and the grammar's output validates."""
    from pagedllm.spec_decode.verify import sample_rows
    from test_spec_decode import NGRAM

    spec = LLM(tiny_chat_model(), device="cpu", max_model_len=512, kv_cache_memory=64 << 20, speculative_config=NGRAM)
    eng, worker = spec.llm_engine, spec.llm_engine.worker
    prompts = ["one two three four one two three four one two three four one two",
               "red green blue red green blue red green blue red"]
    plain = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    finish, moved = worker.finish_model, []

    def recording_finish(pending, grammar=None):
        step, sampled = finish(pending, grammar)
        if grammar is not None and step.num_logits is not None:
            rows = grammar.rows_in(step.requests)[0]
            moved.append(sample_rows(step.num_logits, rows) != rows)
        return step, sampled

    worker.finish_model = recording_finish
    try:
        for i, p in enumerate(prompts):
            eng.add_request(f"p{i}", p, plain)
        while eng.get_stats().spec_decode_num_drafts == 0:
            eng.step()
        schema = SCHEMAS[0]
        eng.add_request("g", "rec:", _json_params(schema, temperature=0))
        eng.requests["g"][1].structured.future.result(timeout=120)  # compiled: admitted at the next step
        done = {}
        while eng.has_unfinished_requests():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
    finally:
        del worker.finish_model
    assert any(moved), moved
    assert [done[f"p{i}"].outputs[0].token_ids for i in range(2)] == want
    _validate_all([done["g"]], schema)
    assert eng.kv.num_used_blocks == 0


def test_grammar_masks_travel_with_pipeline_batches(llm):
    """Pipeline parallel keeps two batches of disjoint requests in flight: each carries the masks made when it was
    scheduled, so grammar and plain requests give the one-rank engine's greedy tokens."""
    threads = torch.get_num_threads()
    pp = LLM(tiny_chat_model(), device="cpu", max_model_len=512, kv_cache_memory=64 << 20, pipeline_parallel_size=2)
    try:
        grammars = [StructuredOutputsParams(choice=["yes", "no", "maybe later"]),
                    StructuredOutputsParams(regex=r"[a-z]{3,8}( [0-9]{1,3})?")]
        prompts = [f"Answer {i}:" for i in range(6)]
        params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=grammars[i % 2]) if i % 3 else
                  SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) for i in range(6)]
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        outs = pp.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        for i in (1, 2, 4, 5):
            c = outs[i].outputs[0]
            ok = c.text in grammars[0].choice if i % 2 == 0 else re.fullmatch(grammars[1].regex, c.text)
            assert c.finish_reason == "stop" and ok, (i, c)
        assert pp.llm_engine.executor.max_in_flight == 2
    finally:
        pp.llm_engine.shutdown()
        torch.set_num_threads(threads)
