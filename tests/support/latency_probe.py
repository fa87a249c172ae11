"""Does a hostile request hurt everyone else? Plain latency of a live server, idle and next to a hostile request.

``LatencyProbe(base_url, api_key, model)`` first measures the idle latency (median of a few samples) of a small keyed
completion and of ``GET /health``; ``during(hostile)`` then runs ``hostile()`` (again and again for at least
``min_s``, in ``concurrency`` forked processes) while two probe threads send those same two requests back to back, and
reports the maxima seen meanwhile (``ProbeReport``). Each probe has its own keep-alive connection and the hostile load
runs in other processes, so the probe measures the server, not this process's GIL.
"""

from __future__ import annotations

import multiprocessing
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import httpx


@dataclass
class ProbeReport:
    """Idle medians and the maxima seen while the hostile request ran (seconds)."""

    idle_completion_s: float
    idle_health_s: float
    max_completion_s: float = 0.0
    max_health_s: float = 0.0
    completions: int = 0
    health_checks: int = 0
    hostile_s: float = 0.0
    results: list = field(default_factory=list)  # what each hostile() call returned
    errors: list = field(default_factory=list)  # probe failures (a probe must never fail)

    def completion_bound(self, factor: float = 10.0, floor_s: float = 0.5) -> float:
        """The bound on a plain completion next to a hostile request: ``factor`` x idle, or ``floor_s``."""
        return max(factor * self.idle_completion_s, floor_s)

    def within(self, health_s: float = 0.1, factor: float = 10.0, floor_s: float = 0.5) -> bool:
        return (not self.errors and self.completions > 0 and self.health_checks > 0
                and self.max_health_s < health_s and self.max_completion_s <= self.completion_bound(factor, floor_s))

    def __str__(self) -> str:
        return (f"completion idle {self.idle_completion_s * 1e3:.0f} ms, max {self.max_completion_s * 1e3:.0f} ms "
                f"over {self.completions}; /health idle {self.idle_health_s * 1e3:.1f} ms, max "
                f"{self.max_health_s * 1e3:.1f} ms over {self.health_checks}; hostile phase {self.hostile_s:.2f} s"
                + (f"; probe errors {self.errors[:3]}" if self.errors else ""))


class LatencyProbe:
    def __init__(self, base_url: str, api_key: Optional[str], model: str, prompt: str = "Hello",
                 max_tokens: int = 4, health_interval_s: float = 0.01):
        self.base_url = base_url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True}
        self.health_interval_s = health_interval_s
        self._idle: Optional[tuple[float, float]] = None

    # ---- one sample each ------------------------------------------------------------------------------------------
    def _completion(self, client: httpx.Client) -> float:
        t = time.perf_counter()
        r = client.post(f"{self.base_url}/v1/completions", json=self.body, headers=self.headers)
        took = time.perf_counter() - t
        if r.status_code != 200:
            raise AssertionError(f"probe completion got {r.status_code}: {r.text[:200]}")
        return took

    def _health(self, client: httpx.Client) -> float:
        t = time.perf_counter()
        r = client.get(f"{self.base_url}/health")
        took = time.perf_counter() - t
        if r.status_code != 200:
            raise AssertionError(f"probe /health got {r.status_code}")
        return took

    def idle(self, samples: int = 7) -> tuple[float, float]:
        """(completion, /health) idle medians, measured once (after a warm-up of each)."""
        if self._idle is None:
            with httpx.Client(timeout=30) as c:
                self._completion(c), self._health(c)
                comp = [self._completion(c) for _ in range(samples)]
                health = []
                for _ in range(samples):
                    health.append(self._health(c))
                    time.sleep(self.health_interval_s)
            self._idle = (statistics.median(comp), statistics.median(health))
        return self._idle

    # ---- next to a hostile request --------------------------------------------------------------------------------
    def during(self, hostile: Callable[[], Any], min_s: float = 1.0, concurrency: int = 1) -> ProbeReport:
        """Run ``hostile()`` in ``concurrency`` forked processes, each at least once and until ``min_s`` passed,
        while the two probes run here on threads; the report holds every hostile result (an exception as its repr)
        and the probes' maxima. Processes, so that building and sending hostile bodies never takes this process's
        GIL from the probes."""
        idle_c, idle_h = self.idle()
        rep = ProbeReport(idle_c, idle_h)
        lock = threading.Lock()
        done = threading.Event()
        ctx = multiprocessing.get_context("fork")
        results = ctx.Queue()
        start = time.monotonic()

        def attack() -> None:
            out: list = []
            while True:
                try:
                    out.append(hostile())
                except Exception as e:  # noqa: BLE001 - reported, the test decides
                    out.append(repr(e))
                if time.monotonic() - start >= min_s:
                    break
            results.put(out)

        def probe(kind: str) -> None:
            with httpx.Client(timeout=60) as c:
                while not done.is_set():
                    try:
                        took = self._completion(c) if kind == "completion" else self._health(c)
                    except Exception as e:  # noqa: BLE001 - a failed probe fails the check
                        with lock:
                            rep.errors.append(f"{kind}: {e!r}")
                        return
                    with lock:
                        if kind == "completion":
                            rep.completions += 1
                            rep.max_completion_s = max(rep.max_completion_s, took)
                        else:
                            rep.health_checks += 1
                            rep.max_health_s = max(rep.max_health_s, took)
                    if kind == "health":
                        time.sleep(self.health_interval_s)

        attackers = [ctx.Process(target=attack, daemon=True) for _ in range(concurrency)]
        for p in attackers:  # forked before the probe threads exist
            p.start()
        probes = [threading.Thread(target=probe, args=(k,), daemon=True) for k in ("completion", "health")]
        for t in probes:
            t.start()
        for _ in attackers:
            rep.results.extend(results.get())
        rep.hostile_s = time.monotonic() - start
        done.set()
        for p in attackers:
            p.join(30)
        for t in probes:
            t.join(60)
        return rep

    def check(self, hostile: Callable[[], Any], attempts: int = 3, **kw) -> ProbeReport:
        """``during`` until the bounds hold, at most ``attempts`` times (the machine is shared: a neighbour's burst
        can stall one attempt; a server that stalls its loop fails every one); returns the last report."""
        for _ in range(attempts):
            rep = self.during(hostile, **kw)
            if rep.within():
                return rep
        return rep
