"""Every user error of the CLI is one line on stderr naming the problem, exit code 2; a runtime failure is one line,
exit code 1; ``--debug`` / ``PAGEDLLM_LOG_LEVEL=DEBUG`` show the traceback. Real subprocesses, as a user runs them."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from server_utils import tiny_chat_model


def _run(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _one_line_error(p: subprocess.CompletedProcess, code: int, *words: str) -> str:
    # start-up stage lines ("INFO ... pagedllm.startup: reading weights ...") may precede the error
    lines = [line for line in p.stderr.splitlines() if line.strip() and not line.startswith("INFO ")]
    assert p.returncode == code, (p.returncode, p.stderr[-3000:])
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert lines[0].startswith("pagedllm ") and ": error: " in lines[0], lines[0]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def unsupported_model(tmp_path_factory) -> str:
    """A real HF folder of an architecture pagedllm does not implement (GPT-2)."""
    from transformers import GPT2Config

    d = tmp_path_factory.mktemp("gpt2")
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0,
               architectures=["GPT2LMHeadModel"]).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def corrupt_model(tmp_path_factory) -> str:
    """The tiny model with its weights file truncated: a runtime failure while loading, not a user flag."""
    d = tmp_path_factory.mktemp("corrupt")
    src = tiny_chat_model()
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), d / name)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    return str(d)


@pytest.mark.parametrize("args,words", [
    (("generate", "--device", "nope", "x"), ("device 'nope'", "known backends")),
    (("generate", "--model", "/no/such/model", "x"), ("model: /no/such/model does not exist",)),
    (("generate", "--max-tokens", "-3", "x"), ("max_tokens", ">= 1")),
    (("serve", "/no/such/model", "--port", "0"), ("model: /no/such/model does not exist",)),
    (("generate", "--block-size", "7", "x"), ("block_size", "power of two")),
    (("chat", "--url", "http://127.0.0.1:9/v1", "--quick", "hi"), ("url: cannot connect",)),
    (("bench", "serve", "--base-url", "http://127.0.0.1:9"), ("base_url: cannot connect",)),
    (("bench", "sweep", "--base-url", "http://127.0.0.1:9", "--max-num-seqs", "4"), ("max_num_seqs",)),
], ids=["unknown-device", "missing-model", "bad-flag-value", "serve-missing-model", "bad-block-size", "chat-no-server", "bench-no-server",
        "sweep-conflict"])
def test_user_error_is_one_line_exit_2(args, words):
    _one_line_error(_run(*args), 2, *words)


def test_model_we_cannot_run(unsupported_model):
    _one_line_error(_run("generate", "--model", unsupported_model, "x"), 2, "unsupported model architecture",
                    "GPT2LMHeadModel")


def test_out_of_kv_memory():
    _one_line_error(_run("generate", "--model", tiny_chat_model(), "--kv-cache-memory", "1000", "x"), 2,
                    "kv_cache_memory")


def test_port_in_use_fails_before_the_model_loads():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = _run("serve", tiny_chat_model(), "--port", str(port), timeout=60)
    line = _one_line_error(p, 2, f"127.0.0.1:{port}", "--port")
    assert "port" in line.split(": error: ")[1].split(":")[0]


def test_runtime_failure_is_one_line_exit_1_and_debug_shows_traceback(corrupt_model):
    _one_line_error(_run("generate", "--model", corrupt_model, "x"), 1, "--debug")
    p = _run("generate", "--model", corrupt_model, "x", "--debug")
    assert p.returncode == 1 and "Traceback (most recent call last)" in p.stderr, p.stderr[-2000:]
    p = _run("generate", "--device", "nope", "x", env={"PAGEDLLM_LOG_LEVEL": "DEBUG"})
    assert p.returncode == 2 and "Traceback (most recent call last)" in p.stderr and "BackendError" in p.stderr


def test_argparse_errors_keep_exit_2():
    line = _one_line_error(_run("generate", "--max-tokens", "lots", "x"), 2, "invalid int value")
    assert line.endswith("`pagedllm generate --help` lists the options"), line


@pytest.mark.parametrize("args,hint", [
    (("generate", "--max-model-lenn", "64", "x"),
     "unrecognized argument --max-model-lenn; did you mean --max-model-len?"),
    (("serve", "--model-im", "native"), "unrecognized argument --model-im; did you mean --model-impl?"),
    (("bench", "sweep", "--request-rats", "1"), "did you mean --request-rates?"),
    (("serv", "--port", "0"), "unknown command 'serv'; did you mean serve?"),
    (("generate", "--kv-cache-dtype", "fp9", "x"), "invalid choice 'fp9'; did you mean fp8?"),
], ids=["flag", "no-prefix-matching", "nested-command-flag", "command", "choice"])
def test_mistyped_name_gets_one_line_with_the_closest(args, hint):
    """One line naming the closest valid flag, command or choice, exit 2: no usage dump, no abbreviations."""
    p = _run(*args)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and p.stderr.startswith("pagedllm"), p.stderr
    assert hint in p.stderr and "usage:" not in p.stderr, p.stderr


def test_serve_accepts_model_as_a_flag():
    """`serve --model X` is the model (vLLM accepts it beside the positional form), not `--model-impl X`."""
    _one_line_error(_run("serve", "--model", "/no/such/model", "--port", "0"), 2,
                    "model: /no/such/model does not exist")
    _one_line_error(_run("serve", "/a", "--model", "/b", "--port", "0"), 2, "model: given twice")
