"""A ``pagedllm serve`` subprocess and a ``pagedllm bench serve`` run against it, for the benchmarks that start their
own servers (``bench sweep``, ``bench serve-vs-offline``, ``bench dp-ep``): one copy of the start / health / stop
logic, so a failed start always leaves no server behind and names its log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Optional, Sequence

#: ``python -m pagedllm.cli``: children run this interpreter's pagedllm (the same checkout and venv).
PAGEDLLM = (sys.executable, "-m", "pagedllm.cli")


class ServeProcess:
    """``pagedllm serve [MODEL] SERVE_ARGS`` on a free loopback port, its output in ``log_path``; ready on return
    (``/health`` answered), or stopped and a ``RuntimeError`` carrying the log's tail."""

    def __init__(self, model: Optional[str], serve_args: Sequence[str], log_path: str, timeout: float = 600.0,
                 env: Optional[dict] = None):
        from pagedllm.executor.base import free_port  # heavy: torch, not at CLI start

        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        cmd = [*PAGEDLLM, "serve", *([model] if model else []), "--port", str(port), "--uvicorn-log-level", "warning",
               *serve_args]
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"`pagedllm serve` did not come up (log {log_path}):\n{self.log_text()[-2000:]}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        """SIGTERM (a clean shutdown: the server logs its summaries), SIGKILL after 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> "ServeProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def bench_serve(base_url: str, bench_args: Sequence[str], json_path: str, prefix: Sequence[str] = (),
                env: Optional[dict] = None) -> dict:
    """Run ``pagedllm bench serve`` in its own process (``prefix``: e.g. ``taskset -c 1``) and return its JSON."""
    done = subprocess.run([*prefix, *PAGEDLLM, "bench", "serve", "--base-url", base_url, *bench_args, "--json",
                           json_path], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"`pagedllm bench serve` failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    with open(json_path) as f:
        result = json.load(f)
    os.unlink(json_path)
    return result
