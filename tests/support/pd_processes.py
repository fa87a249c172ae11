"""Prefill/decode disaggregation's processes for fault tests: ``pagedllm serve`` instances on fixed loopback ports (so
one can be killed and started again where the router expects it), optionally run under a wrapper command (a mount
namespace with a full file system), and ``pagedllm router``. Every wait has a timeout; ``stop`` always ends the
process it started (and the engine process under it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

import httpx
from server_utils import API_KEY, descendants, free_port, tiny_chat_model

BS = 16
AUTH = {"Authorization": f"Bearer {API_KEY}"}

#: Runs the command after ``--`` with a ``SIZE`` tmpfs mounted on ``DIR`` in a private mount namespace (a real full
#: disk: writes past SIZE fail with ENOSPC). Arguments: DIR SIZE -- command...
FULL_FS = ["unshare", "-rm", "--", "sh", "-c", 'mount -t tmpfs -o size="$1" tmpfs "$0" && shift && exec "$@"']


def loopback_config(role: str, store: str, ttl_s: float) -> str:
    return json.dumps({"kv_connector": "LoopbackConnector", "kv_role": role,
                       "kv_connector_extra_config": {"shared_storage_path": store, "ttl_s": ttl_s}})


class Instance:
    """``pagedllm serve`` (the tiny chat model, served as ``test-model``) on a fixed port."""

    def __init__(self, *extra: str, wrap: Sequence[str] = (), port: Optional[int] = None, timeout: float = 300.0):
        self.extra, self.wrap, self.timeout = list(extra), list(wrap), timeout
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None
        self.log = tempfile.NamedTemporaryFile(prefix="pagedllm-pd-serve-", suffix=".log", delete=False)
        self.start()

    def start(self) -> None:
        cmd = [*self.wrap, sys.executable, "-m", "pagedllm.cli", "serve", tiny_chat_model(), "--device", "cpu",
               "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "test-model",
               "--uvicorn-log-level", "warning", "--max-model-len", "512", "--block-size", str(BS), "--api-key",
               API_KEY, *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.output()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"server not healthy after {self.timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()[-6000:]

    def kill(self) -> None:
        """SIGKILL, the engine process too (it would exit with its parent, a moment later)."""
        if self.proc is None:
            return
        pids = descendants(self.proc.pid) if self.proc.poll() is None else []
        for pid in [self.proc.pid, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


class _RouterProcess:
    """``pagedllm router ARGS`` on a free port; ``healthy=False``: wait only until it answers (its backends may all
    be down)."""

    def __init__(self, args: Sequence[str], healthy: bool = True, startup_s: float = 60):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="pagedllm-router-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "router", "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200 or not healthy:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError("the router did not come up")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


class Router(_RouterProcess):
    """``pagedllm router`` in front of one prefill and one decode instance."""

    def __init__(self, prefill: str, decode: str, timeout_s: float = 60, connect_retries: int = 4):
        super().__init__(["--prefill", prefill, "--decode", decode, "--timeout", str(timeout_s),
                          "--connect-retries", str(connect_retries)])


class ReplicaRouter(_RouterProcess):
    """``pagedllm router --backend URL ...`` (``extra``: more flags) over replicas."""

    def __init__(self, backends: Sequence[str], *extra: str, healthy: bool = True, timeout_s: float = 60):
        super().__init__(["--timeout", str(timeout_s), *[a for url in backends for a in ("--backend", url)], *extra],
                         healthy=healthy, startup_s=120)


def router_samples(url: str, name: str, role: Optional[str] = None) -> dict[tuple[str, ...], float]:
    """A metric of ``pagedllm router``'s /metrics as {label values after ``role`` (backend, decision ...): value};
    ``role``: that role's samples only (P/D: ``prefill`` or ``decode``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, ...], float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text):
        for s in fam.samples:
            if s.name == name and role in (None, s.labels.get("role")):
                out[tuple(v for k, v in s.labels.items() if k != "role")] = s.value
    return out
