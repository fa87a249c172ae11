"""The published API schema, fuzzed: schemathesis against a live server's own ``/openapi.json``.

Every generated request (valid and invalid bodies alike) must get a declared status with a body matching the declared
model, never a 5xx, within a time bound; afterwards nothing runs, waits or holds a KV block, and no process is left
beyond the server's own. The server runs with the default (safe) flags plus small limits that bound each request's
work (``--max-model-len 128``, ``--max-num-queued-reqs 16``, ``--request-timeout 10``).
"""

from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_utils import (ServerProcess, cmdline, descendants, gone, is_grammar_process, tiny_chat_model,
                          wait_for_grammar_zygote, wait_idle)

MAX_EXAMPLES = 40  # per operation and generation mode (valid and invalid data)
SLOWEST_S = 15.0
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def schema_server():
    srv = ServerProcess(tiny_chat_model(), "--max-model-len", "128", "--max-num-queued-reqs", "16",
                        "--request-timeout", "10", api_key=None)
    wait_for_grammar_zygote(srv.proc.pid)
    srv.procs_at_start = _census(srv.proc.pid)
    yield srv
    srv.stop()


slowest: list[tuple[float, str]] = []


def test_fuzz_live_schema(schema_server):
    """schemathesis' strategies for every operation of the live schema, valid and invalid bodies, run by hypothesis
    here (its pytest plugin does not load under this pytest); each case is sent and checked."""
    schema = schemathesis.openapi.from_url(f"{schema_server.base_url}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/health"}
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            def run(case):
                t = time.monotonic()
                case.call_and_validate(base_url=schema_server.base_url, checks=CHECKS, timeout=SLOWEST_S + 5)
                took = time.monotonic() - t
                slowest.append((took, f"{case.method} {case.path} ({mode.value})"))
                assert took < SLOWEST_S, (took, case.method, case.path, case.body)

            try:
                run()
            except Unsatisfiable:  # no invalid input exists: no body and no query (GET /health has no parameters
                # at all; /v1/responses/{response_id} takes any string id, an unknown one being a 404)
                assert mode is GenerationMode.NEGATIVE and not len(op.body) and not len(op.query), op.label


def _census(pid: int) -> list[int]:
    """The server's processes but the grammar compile pool's, which replaces its workers by design (after a timed-out
    or grown compile) and forks them once its zygote has imported its libraries: those are bounded, not named."""
    procs = descendants(pid)
    grammar = [p for p in procs if is_grammar_process(p)]
    assert len(grammar) <= 1 + 2, [cmdline(p) for p in grammar]  # the zygote + the default 2 compile workers
    return sorted(p for p in procs if p not in grammar)


def test_after_fuzzing_nothing_is_left(schema_server):
    """Runs after the fuzzing: idle engine, no KV block held, the same processes as at start, server healthy."""
    assert slowest, "the fuzz test did not run"
    took, what = max(slowest)
    print(f"{len(slowest)} generated requests; slowest {took:.2f} s ({what})")
    m = wait_idle(schema_server.base_url)
    assert (m["pagedllm:num_requests_running"], m["pagedllm:num_requests_waiting"],
            m["pagedllm:kv_cache_used_blocks"]) == (0, 0, 0)
    assert httpx.get(f"{schema_server.base_url}/health").status_code == 200
    assert _census(schema_server.proc.pid) == schema_server.procs_at_start, [
        cmdline(p) for p in descendants(schema_server.proc.pid)]
    assert "Traceback" not in schema_server.output()


def test_schema_and_docs_are_served(schema_server):
    spec = httpx.get(f"{schema_server.base_url}/openapi.json").json()
    chat = spec["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")
    ok = chat["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("ChatCompletionResponse") and "text/event-stream" in ok
    assert "422" not in chat["responses"] and {"400", "408", "413", "429", "503"} <= set(chat["responses"])
    assert "CompletionRequest" in spec["components"]["schemas"]
    docs = httpx.get(f"{schema_server.base_url}/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_request_chat_template_refused_by_default(schema_server):
    r = httpx.post(f"{schema_server.url_v1}/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                         "chat_template": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
                                          "{% endfor %}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    assert r.elapsed.total_seconds() < 1.0


def test_sigterm_leaves_no_process(schema_server):
    """Runs last: a graceful stop exits 0 and takes every process along (engine, forkserver, render workers)."""
    procs = descendants(schema_server.proc.pid)
    assert len(procs) >= 5, [cmdline(p) for p in procs]  # engine, resource tracker, forkserver, 2 render workers
    schema_server.terminate()
    assert schema_server.wait(60) == 0
    assert all(gone(p, 15) for p in procs), [cmdline(p) for p in procs if not gone(p, 0)]
