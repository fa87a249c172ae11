"""The CPU backend's shared-memory collectives (``pagedllm_cpu/shm_comm.py``) in real processes on a real gloo
world: the same bits as gloo's all-reduce and all-gather (two ranks), one result on every rank (three), gloo for
tensors over a slot, all ranks falling back together when one opts out, no file left in /dev/shm, and a dead peer
turning into ``CollectiveError`` long before the group's timeout. The TP tests (test_distributed_tp.py) run
their models through it too, and check TP=2 bit for bit against the same split done in one process."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import socket
import time
import traceback

import pytest
import torch

TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plain(t: torch.Tensor) -> tuple:
    """A tensor as plain bytes (tensors themselves cross a queue as shared memory the sender must outlive)."""
    return str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes()


def _tensor(p: tuple) -> torch.Tensor:
    dtype, shape, raw = p
    return torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype.removeprefix("torch."))).view(shape)


def _inputs(rank: int) -> list[torch.Tensor]:
    """What rank ``rank`` all-reduces, in order: decode rows, one row, an odd bf16 shape, a prefill chunk."""
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(*shape, generator=g).to(dtype)
            for shape, dtype in [((64, 576), torch.float32), ((1, 576), torch.float32), ((7, 33), torch.bfloat16),
                                 ((2048, 576), torch.float32)] * 3]


def _worker(rank: int, world: int, port: int, scenario: str, queue) -> None:
    try:
        torch.set_num_threads(1)
        if scenario == "opt_out" and rank == 1:
            os.environ["PAGEDLLM_CPU_SHM_COMM"] = "0"
        import torch.distributed as dist

        from pagedllm.distributed.communicator import CollectiveError, TorchCommunicator
        from pagedllm_cpu.shm_comm import SLOT_BYTES, ShmCommunicator

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        comm = ShmCommunicator(list(range(world)), torch.device("cpu"), TIMEOUT_S)
        out: dict = {"uses_shm": comm.uses_shm}
        if scenario == "dead_peer":
            if rank == 1:
                os._exit(0)  # gone without a word, as a killed worker
            t0 = time.perf_counter()
            try:
                comm.all_reduce(torch.ones(8))
                out["error"] = None
            except CollectiveError as e:
                out["error"] = str(e)
            out["waited_s"] = time.perf_counter() - t0
            queue.put((rank, out))
            return
        sums, gathers, same_as_gloo = [], [], True
        for i, x in enumerate(_inputs(rank)):
            got = comm.all_reduce(x.clone())
            want = TorchCommunicator.all_reduce(comm, x.clone())  # gloo on the same group
            same_as_gloo &= torch.equal(got, want)
            sums.append(_plain(got))
            ids = torch.arange(5, dtype=torch.int64) + 10 * rank + i
            gathered = comm.all_gather(ids, dim=0)
            same_as_gloo &= torch.equal(gathered, TorchCommunicator.all_gather(comm, ids, dim=0))
            gathers.append(gathered.tolist())
        big = torch.ones(SLOT_BYTES // 4 + 1)  # over a slot: gloo
        out.update(same_as_gloo=same_as_gloo, sums=sums, gathers=gathers, big=comm.all_reduce(big)[:3].tolist(),
                   seq=comm.seq)
        comm.barrier()
        queue.put((rank, out))
    except Exception:
        queue.put((rank, {"exception": traceback.format_exc()}))


def _run(world: int, scenario: str = "plain") -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, scenario, queue)) for r in range(world)]
    for p in procs:
        p.start()
    expect = 1 if scenario == "dead_peer" else world
    results = dict(queue.get(timeout=120) for _ in range(expect))
    for p in procs:
        p.join(timeout=60)
    for rank, res in results.items():
        assert "exception" not in res, f"rank {rank}:\n{res['exception']}"
    return results


@pytest.fixture()
def no_leaked_files():
    before = set(glob.glob("/dev/shm/pagedllm-tp-*"))
    yield
    assert set(glob.glob("/dev/shm/pagedllm-tp-*")) - before == set(), "a shared-memory file was left behind"


def test_two_ranks_match_gloo_bit_for_bit(no_leaked_files):
    res = _run(2)
    assert all(r["uses_shm"] for r in res.values())
    assert all(r["same_as_gloo"] for r in res.values())
    assert res[0]["big"] == [2.0, 2.0, 2.0]
    assert res[0]["seq"] == 24  # 12 all-reduces + 12 all-gathers through shared memory (the big one: gloo)


def test_three_ranks_agree_and_sum(no_leaked_files):
    res = _run(3)
    assert all(r["uses_shm"] for r in res.values())
    for a, b, c in zip(res[0]["sums"], res[1]["sums"], res[2]["sums"]):
        assert a == b == c  # one result everywhere (the same bytes): slots added in rank order
    for got, x0, x1, x2 in zip(res[0]["sums"], _inputs(0), _inputs(1), _inputs(2)):
        assert torch.equal(_tensor(got), (x0 + x1) + x2)
    for i, g in enumerate(res[0]["gathers"]):
        assert g == [10 * r + i + k for r in range(3) for k in range(5)]


def test_one_rank_opting_out_moves_the_whole_group_to_gloo(no_leaked_files):
    res = _run(2, "opt_out")
    assert not any(r["uses_shm"] for r in res.values())
    assert all(r["same_as_gloo"] for r in res.values())


def test_a_dead_peer_is_an_error_not_a_hang():
    res = _run(2, "dead_peer")[0]
    assert res["uses_shm"]
    assert res["error"] is not None and "died" in res["error"]
    assert res["waited_s"] < 10  # found by the liveness check, not the 60 s timeout
