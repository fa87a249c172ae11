"""``--model org/name`` resolves a Hugging Face Hub id as vLLM does: the local HF cache first (offline works when the
files are cached), a download otherwise, and with ``HF_HUB_OFFLINE=1`` and no cached copy one line naming the id,
the cache and the variable. No network: a real cache in huggingface_hub's layout is built in tmp and the CLI runs in
a subprocess pointed at it (``HF_HOME``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from server_utils import free_port, tiny_chat_model

REVISION = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "tiny-org/tiny-chat"


def _run(*args: str, env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **env})


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> str:
    """``HF_HOME`` whose hub cache holds the tiny chat model as ``tiny-org/tiny-chat``: the content-addressed blobs,
    the snapshot's symlinks to them and ``refs/main``, as ``hf download`` leaves them."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    src = tiny_chat_model()
    for i, name in enumerate(sorted(os.listdir(src))):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copy(os.path.join(src, name), blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return str(home)


def test_cached_hub_id_runs_offline(hf_home):
    """The cached snapshot is found without the network, and generates exactly what the same files do as a folder."""
    env = {"HF_HOME": hf_home, "HF_HUB_OFFLINE": "1"}
    args = ("--device", "cpu", "--max-tokens", "6", "Hello there")
    by_id = _run("generate", "--model", REPO_ID, *args, env=env)
    assert by_id.returncode == 0, by_id.stderr[-3000:]
    snapshot = os.path.join(hf_home, "hub", "models--tiny-org--tiny-chat", "snapshots", REVISION)
    assert f"model {REPO_ID}: in the Hugging Face cache, {snapshot}" in by_id.stderr, by_id.stderr
    by_path = _run("generate", "--model", tiny_chat_model(), *args, env=env)
    assert by_path.returncode == 0, by_path.stderr[-3000:]
    assert by_id.stdout == by_path.stdout and by_id.stdout.startswith("Hello there")


def test_offline_and_not_cached_is_one_line(hf_home):
    p = _run("generate", "--model", "tiny-org/not-downloaded", "--device", "cpu", "x",
             env={"HF_HOME": hf_home, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    line = lines[0]
    assert line.startswith("pagedllm generate: error: model: tiny-org/not-downloaded is not in the Hugging Face "
                           "cache"), line
    for words in (os.path.join(hf_home, "hub"), "HF_HUB_OFFLINE=1", "unset HF_HUB_OFFLINE"):
        assert words in line, line


def test_local_path_that_is_not_there_says_what_a_model_may_be():
    p = _run("generate", "--model", "./no/such/folder", "--device", "cpu", "x", env={"HF_HUB_OFFLINE": "1"})
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert "model: ./no/such/folder does not exist" in lines[0] and "Hub id org/name" in lines[0], lines[0]


@pytest.mark.slow
def test_serve_cached_hub_id_under_its_name(hf_home):
    """``serve org/name`` resolves once, in the server process, and clients see the id as the model name."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "serve", REPO_ID, "--device", "cpu", "--port",
                             str(port), "--max-model-len", "128", "--uvicorn-log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": hf_home, "HF_HUB_OFFLINE": "1"})
    try:
        models = None
        for _ in range(480):
            if proc.poll() is not None:
                break
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1.0).json()
                break
            except httpx.HTTPError:
                time.sleep(0.25)
        assert models is not None, f"server exited with {proc.poll()}" if proc.poll() is not None else "not up"
        assert [m["id"] for m in models["data"]] == [REPO_ID]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert err.count(f"model {REPO_ID}: in the Hugging Face cache") == 1, err[-3000:]
