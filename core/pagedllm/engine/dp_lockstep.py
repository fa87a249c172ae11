"""The engine loop of a DP+EP replica (``--data-parallel-size N --enable-expert-parallel``; the exchange itself is
``distributed/dp_ep.py``). vLLM's DP engine loop: replicas step in waves. A wave starts when any replica gets work
while all are idle and ends when an all-reduce of "has work" flags finds none; inside a wave every replica runs one
forward per iteration, its own step or a dummy one, so every MoE layer meets every replica.

Starting a wave needs the idle replicas woken: the replica that got work sends ``("wave", w)`` (``w``: the waves
completed so far, equal on every replica since waves end together) to the server, which sends ``("wake", w)`` to
every other replica (``dp_client.py``). A replica joins wave ``w`` if it is idle having completed ``w`` waves; a
wake for a wave it already ran is stale and ignored (it read the wake after that wave ended). So no replica ever
waits for a wave the others will not run, and an idle group burns no CPU (each blocks on its pipe).

"stop" is part of the flags: every replica of a running wave stops at the same iteration.
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.distributed.dp_ep import LockStep, get_dp_ep_state
from pagedllm.engine.core_process import drain, finish

logger = logging.getLogger(__name__)


def expert_info(engine: Any) -> dict[str, Any]:
    """What this replica holds, read from its model (the server and tests see it in the "ready" message)."""
    st = get_dp_ep_state()
    e0, e1, total = st.experts
    return {"dp_rank": st.rank, "dp_size": st.size, "experts": (e0, e1), "num_experts": total,
            "local_experts_per_layer": [mlp.w13.shape[0] for mlp in st.moe_layers]}


def lockstep_loop(engine: Any, commands: Connection, outputs: Connection) -> None:
    st = get_dp_ep_state()
    lock = LockStep(st)
    running = False
    while True:
        if not running and not engine.has_unfinished_requests():
            commands.poll(None)  # idle: sleep until a command (or EOF) arrives
        items: list[tuple[str, object]] = []
        stop, wakes = drain(engine, commands, items)
        if not running:
            if engine.has_unfinished_requests():  # work while the group is idle: start wave st.wave
                running = True
                outputs.send(("wave", st.wave))
            elif st.wave in wakes:  # another replica started it
                running = True
        if running:
            any_work, any_stop = lock.sync(engine.has_unfinished_requests(), stop)
            if any_stop:
                _log_summary(st)
                finish(engine, outputs)
                return
            if any_work:
                items.extend((o.request_id, o) for o in lock.step(engine))
            else:  # every replica is idle: the wave ends here on all of them
                st.wave += 1
                running = False
        elif stop:
            _log_summary(st)
            finish(engine, outputs)
            return
        engine.stats.dp_steps, engine.stats.dp_dummy_steps, engine.stats.dp_waves = st.steps, st.dummy_steps, st.wave
        outputs.send(("out", items, engine.get_stats()))


def _log_summary(st: Any) -> None:
    """The exchange's cost, for benchmarks: time this replica spent in the MoE collectives (waiting for the slower
    replica included) per lock-step forward."""
    wait = getattr(st.comm, "wait_s", None)
    per = f", {1e3 * wait / st.steps:.2f} ms per forward in MoE exchanges" if wait is not None and st.steps else ""
    logger.info("DP+EP replica %d: %d lock-step forwards (%d dummy), experts %s of %d%s", st.rank, st.steps,
                st.dummy_steps, st.experts[:2], st.experts[2], per)
