"""``pagedllm serve --speculative-config``: the real openai client against a real server process; streamed and
non-streamed greedy completions equal offline plain decoding, /metrics counts drafts, a bad config fails startup
naming the key."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from pagedllm import LLM, SamplingParams
from server_utils import API_KEY, ServerProcess, metrics, tiny_chat_model, wait_idle

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "acceptance_threshold": 0.0, "disable_by_batch_size": 0}  # never throttled: counts do not depend on timing
PROMPT = "one two three four five six seven eight one two three four five six seven eight one two"


@pytest.fixture(scope="module")
def model_path() -> str:
    return tiny_chat_model()


@pytest.fixture(scope="module")
def server(model_path):
    srv = ServerProcess(model_path, "--speculative-config", json.dumps(SPEC))
    yield srv
    srv.stop()


def test_completions_equal_plain_offline_and_metrics_count_drafts(server, model_path):
    client = openai.OpenAI(base_url=server.url_v1, api_key=API_KEY, max_retries=0, timeout=60)
    ref = LLM(model_path, device="cpu").generate(PROMPT, SamplingParams(temperature=0, max_tokens=40,
                                                                        ignore_eos=True), use_tqdm=False)
    want = ref[0].outputs[0].text
    out = client.completions.create(model=server.served_name, prompt=PROMPT, max_tokens=40, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == want and out.usage.completion_tokens == 40
    stream = client.completions.create(model=server.served_name, prompt=PROMPT, max_tokens=40, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == want
    m = wait_idle(server.base_url)
    assert m["pagedllm:spec_decode_num_drafts_total"] > 0
    assert 0 < m["pagedllm:spec_decode_num_accepted_tokens_total"] <= m["pagedllm:spec_decode_num_draft_tokens_total"]
    assert 0 < m["pagedllm:spec_decode_acceptance_rate"] <= 1
    assert m["pagedllm:spec_decode_mean_accepted_length"] > 1
    assert m["pagedllm:kv_cache_used_blocks"] == 0


def test_bad_speculative_config_fails_startup_naming_the_key(model_path):
    p = subprocess.run([sys.executable, "-m", "pagedllm.cli", "generate", "--model", model_path, "--device", "cpu",
                        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}', "hi"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "speculative_config.num_speculative_tokens" in p.stderr + p.stdout
