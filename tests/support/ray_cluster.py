"""A two-node Ray cluster on this machine for tests: ``ray start --head`` on 127.0.0.1 plus a second raylet, one CPU
each, under a private temp dir; torn down by process id (only this cluster's processes, never ``ray stop``, which
would stop every Ray process of the user)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil

from server_utils import free_port


def _run(cmd: list[str], env: dict) -> None:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd[1:3])} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


class TwoNodeRay:
    def __init__(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths have a length limit
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        # No token auth (a token file another Ray session left in ~/.ray would otherwise split the two nodes).
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
        env.pop("RAY_ADDRESS", None)
        common = ["--num-cpus", "1", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
        try:
            _run([ray, "start", "--head", "--port", str(self.port), "--include-dashboard", "false",
                  "--temp-dir", self.temp_dir, *common], env)
            _run([ray, "start", "--address", self.address, *common], env)
        except BaseException:
            self.stop()
            raise

    def pids(self) -> list[int]:
        """This cluster's processes: every process naming its temp dir, and their descendants (workers, agents)."""
        found: set[int] = set()
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if any(self.temp_dir in a for a in p.info["cmdline"] or ()):
                    found.add(p.pid)
                    found.update(c.pid for c in p.children(recursive=True))
            except psutil.Error:
                pass
        return sorted(found)

    def stop(self) -> None:
        procs = []
        for pid in self.pids():
            try:
                procs.append(psutil.Process(pid))
                os.kill(pid, signal.SIGTERM)
            except (ProcessLookupError, psutil.Error):
                pass
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        time.sleep(0.1)
