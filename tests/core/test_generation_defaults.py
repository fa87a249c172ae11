"""The model's ``generation_config.json`` supplies default sampling parameters (vLLM's ``--generation-config auto``):
``LLM.generate`` without SamplingParams and OpenAI requests that omit a field use them; a request's own value wins;
``--generation-config vllm`` ignores them. The oracle is the same engine run with the same values passed
explicitly (``top_k=1`` makes sampling deterministic, so outputs compare token for token)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.errors import ParamError
from pagedllm.generation_defaults import get_diff_sampling_param
from server_utils import ServerProcess, tiny_chat_model

#: What the model's creator recommends; token ids and do_sample are no sampling fields.
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "top_k": 1, "top_p": 0.9,
                     "repetition_penalty": 1.3, "max_new_tokens": 6}
DEFAULTS = {"top_k": 1, "top_p": 0.9, "repetition_penalty": 1.3, "max_tokens": 6}
PROMPT = "hi"  # the tiny model repeats itself greedily here, so the repetition penalty shows in the tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("with_generation_config")
    src = tiny_chat_model()
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), d / name)
    (d / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return str(d)


def test_defaults_are_the_sampling_fields_that_differ(model_dir, tmp_path):
    assert get_diff_sampling_param(model_dir, "auto") == DEFAULTS
    assert get_diff_sampling_param(model_dir, "vllm") == {}
    assert get_diff_sampling_param(tiny_chat_model(), "auto") == {}  # eos/bos only: nothing to sample with
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "min_p": 0.05}))
    assert get_diff_sampling_param(model_dir, str(other)) == {"temperature": 0.6, "min_p": 0.05}


def test_bad_generation_config_names_the_field(tmp_path):
    with pytest.raises(ParamError, match="generation_config"):
        EngineConfig(generation_config="/no/such/folder")
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ParamError, match=r"^generation_config: .*generation_config.json sets top_p: .*"
                                         r"--generation-config vllm"):
        get_diff_sampling_param(str(tmp_path), "auto")


def test_llm_generate_without_params_uses_them(model_dir):
    llm = LLM(model_dir, device="cpu", max_model_len=128)
    assert llm.default_sampling_params == DEFAULTS
    assert llm.get_default_sampling_params() == SamplingParams(**DEFAULTS)
    got = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0].token_ids
    explicit = llm.generate([PROMPT], SamplingParams(**DEFAULTS), use_tqdm=False)[0].outputs[0].token_ids
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert list(got) == list(explicit) and len(got) == 6
    assert list(got) != list(greedy.token_ids)  # the repetition penalty was applied


def test_generation_config_vllm_ignores_them(model_dir):
    llm = LLM(model_dir, device="cpu", max_model_len=128, generation_config="vllm")
    assert llm.default_sampling_params == {} and llm.get_default_sampling_params() == SamplingParams()
    assert len(llm.generate([PROMPT], use_tqdm=False)[0].outputs[0].token_ids) == SamplingParams().max_tokens


def test_cli_flag(model_dir):
    """``--generation-config vllm`` reaches the engine (no defaults line); a bad value is one line, exit 2."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pagedllm.cli", "generate", "--model", model_dir, "--device", "cpu",
           "--max-tokens", "2"]
    p = subprocess.run(cmd + ["--generation-config", "vllm", PROMPT], capture_output=True, text=True, timeout=180,
                       env=env)
    assert p.returncode == 0 and "engine ready" in p.stderr and "generation defaults" not in p.stderr, p.stderr
    p = subprocess.run(cmd + ["--generation-config", "nope", PROMPT], capture_output=True, text=True, timeout=180,
                       env=env)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "error: generation_config: must be 'auto'" in lines[0], p.stderr


def test_cli_generate_uses_them_and_flags_win(model_dir):
    """``pagedllm generate`` with no sampling flags samples as the model's defaults say (same text as LLM with them
    passed explicitly); ``--max-tokens`` overrides only that field."""
    llm = LLM(model_dir, device="cpu", max_model_len=128)
    want = {n: llm.generate([PROMPT], SamplingParams(**{**DEFAULTS, "max_tokens": n}),
                            use_tqdm=False)[0].outputs[0].text for n in (6, 3)}
    llm.shutdown()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pagedllm.cli", "generate", "--model", model_dir, "--device", "cpu",
           "--max-model-len", "128"]
    for flags, n in (([], 6), (["--max-tokens", "3"], 3)):
        p = subprocess.run(cmd + flags + [PROMPT], capture_output=True, text=True, timeout=180, env=env)
        assert p.returncode == 0, p.stderr
        assert p.stdout == PROMPT + want[n] + "\n", (p.stdout, want[n])
        assert "generation defaults from" in p.stderr


@pytest.mark.slow
def test_openai_server_fills_only_omitted_fields(model_dir):
    from openai import OpenAI

    server = ServerProcess(model_dir, "--max-model-len", "128", env={"OMP_NUM_THREADS": "1"})
    try:
        client = OpenAI(base_url=server.url_v1, api_key=server.api_key)
        name = server.served_name
        omitted = client.completions.create(model=name, prompt=PROMPT)
        explicit = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, top_p=0.9,
                                             extra_body={"top_k": 1, "repetition_penalty": 1.3})
        greedy = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0,
                                           extra_body={"repetition_penalty": 1.0})
        assert omitted.usage.completion_tokens == 6
        assert omitted.choices[0].text == explicit.choices[0].text != greedy.choices[0].text
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPT}])
        assert chat.usage.completion_tokens == 6  # max_new_tokens as the default max_tokens
        short = client.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPT}],
                                               max_completion_tokens=2)
        assert short.usage.completion_tokens == 2  # the request's own value wins
        log = server.output()
    finally:
        server.stop()
    assert log.count("generation defaults from ") == 1, log[-3000:]  # printed once at start-up
