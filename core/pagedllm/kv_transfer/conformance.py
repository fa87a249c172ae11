"""Connector conformance: drive a connector class through the whole contract with core's real scheduler, block
manager and reference copy ops, and check what it put in the device cache.

No model runs: a "forward" writes, at each token's slot, a value derived from the token and everything before it
(a rolling hash), so a block's correct K/V is known exactly. Before every step the check reads back every block a
scheduled request counts as computed — device hits and connector loads alike — and compares. Scenarios: a prefix
evicted from the device pool and asked for again (the connector may serve it), loads reported as failed and a
``start_load_kv`` that raises (core must recompute, never read a wrong block), finished requests whose blocks the
connector keeps (``request_finished`` True) and must release through ``get_finished``, and the return shapes of
every scheduler-side call. ``check_connector`` returns a report; a violation raises :class:`ConnectorCheckFailed`.

    python -c "from pagedllm.kv_transfer.conformance import check_connector; print(check_connector('MyConnector'))"
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from pagedllm.backend import ref_ops
from pagedllm.backend.hookspec import KVCacheSpec
from pagedllm.kv_transfer.base import KVConnectorBase_V1, KVConnectorContext, KVConnectorMetadata, KVConnectorRole
from pagedllm.kv_transfer.config import KVTransferConfig
from pagedllm.kv_transfer.factory import connector_class
from pagedllm.kv_transfer.runtime import KVTransfer
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.kv_manager import KVCacheManager
from pagedllm.sched.request import Request, RequestStatus
from pagedllm.sched.scheduler import Scheduler

BLOCK_SIZE, NUM_BLOCKS, LAYERS, HEADS, HEAD_SIZE = 4, 12, 2, 2, 8
MOD = 1 << 22  # rolling-hash values stay exact in float32


class ConnectorCheckFailed(AssertionError):
    """A connector broke the contract; the message says which check and how."""


@dataclass
class ConnectorReport:
    connector: str
    checks: list[str] = field(default_factory=list)
    loaded_tokens: int = 0  # tokens the connector served after their device blocks were evicted
    recomputed_requests: int = 0  # requests core recomputed after injected load failures

    def __str__(self) -> str:
        return (f"{self.connector}: {len(self.checks)} checks passed ({', '.join(self.checks)}); served "
                f"{self.loaded_tokens} evicted tokens; recomputed {self.recomputed_requests} requests after failures")


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise ConnectorCheckFailed(what)


class _Sim:
    """A scheduler, block manager and device caches with a model-free forward (see the module docstring)."""

    def __init__(self, cls: type[KVConnectorBase_V1], config: KVTransferConfig, identity: str,
                 fail: Optional[str] = None):
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=True)
        self.sched = Scheduler(self.kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
        spec = KVCacheSpec(LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, torch.float32, torch.device("cpu"))
        self.caches = ref_ops.allocate_kv_cache(LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, torch.float32, "cpu")
        names = [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
        ctx = KVConnectorContext(
            model_identity=identity, block_size=BLOCK_SIZE, num_device_blocks=NUM_BLOCKS,
            bytes_per_block=spec.bytes_per_block, kv_spec=spec, layer_names=names, block_hashes=self.kv.block_hashes,
            allocate_host_kv_cache=lambda s, pin: ref_ops.allocate_kv_cache(
                s.num_layers, s.num_blocks, s.block_size, s.num_kv_heads, s.head_size, s.dtype, "cpu"),
            swap_kv_blocks=ref_ops.swap_kv_blocks, gather_kv_blocks=ref_ops.gather_kv_blocks)
        sched_side = cls(config, KVConnectorRole.SCHEDULER, ctx)
        worker_side = cls(config, KVConnectorRole.WORKER, ctx)
        if fail == "report":  # every load of the step is reported as failed
            worker_side.get_block_ids_with_load_errors = lambda: set(self.kv.pending_load)
        elif fail == "raise":
            def boom(**kwargs: Any) -> None:
                raise RuntimeError("injected load failure")
            worker_side.start_load_kv = boom
        self.rt = KVTransfer(sched_side, worker_side, self.kv, dict(zip(names, self.caches)))
        worker_side.register_kv_caches(self.rt.caches)
        self.sched.connector = self.rt
        self.kv.pool.on_evict = self.rt.on_evict
        self.external_tokens = 0
        self.ids = 0

    @staticmethod
    def value(tokens: list[int], p: int) -> float:
        r = 0
        for t in tokens[:p + 1]:
            r = (r * 1009 + t + 1) % MOD
        return float(r)

    def add(self, tokens: list[int], max_tokens: int = 2) -> Request:
        self.ids += 1
        req = Request(f"r{self.ids}", tokens, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)
        self.sched.add_request(req)
        return req

    def _check_computed(self, out: Any) -> None:
        for s in out.scheduled:
            req, ids = s.request, self.kv.block_ids(s.request.request_id)
            for p in range(s.num_computed_tokens):
                slot = (ids[p // BLOCK_SIZE], p % BLOCK_SIZE)
                want = self.value(req.all_token_ids, p)
                for layer, cache in enumerate(self.caches):
                    got_k, got_v = cache[0][slot].flatten()[0].item(), cache[1][slot].flatten()[0].item()
                    _expect(got_k == want + layer and got_v == -want - layer,
                            f"request {req.request_id}: token {p} (block {ids[p // BLOCK_SIZE]}) is counted as "
                            f"computed but holds other K/V than its prefix's (a load wrote the wrong block?)")

    def step(self) -> None:
        out = self.sched.schedule()
        self.rt.before_forward(out)
        self._check_computed(out)
        for s in out.scheduled:  # what the model would write
            req, ids = s.request, self.kv.block_ids(s.request.request_id)
            for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                v = self.value(req.all_token_ids, p)
                for layer, cache in enumerate(self.caches):
                    cache[0][ids[p // BLOCK_SIZE], p % BLOCK_SIZE] = v + layer
                    cache[1][ids[p // BLOCK_SIZE], p % BLOCK_SIZE] = -v - layer
        if out.scheduled:
            self.rt.after_forward(out)
        self.sched.update(out)
        for s in out.scheduled:
            req = s.request
            if s.samples and not req.is_finished:
                req.append_token((req.all_token_ids[-1] * 7 + 3) % 500 + 3)
                if req.num_output_tokens >= req.max_tokens:
                    self.sched.finish(req, RequestStatus.FINISHED_LENGTH)

    def drain(self, limit: int = 200) -> None:
        for _ in range(limit):
            if not self.sched.has_unfinished() and not self.rt.has_pending():
                return
            self.step()
        raise ConnectorCheckFailed(f"requests or kept blocks still pending after {limit} steps (get_finished never "
                                   "reported a request whose request_finished returned True?)")


def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def _scenario(cls: type, config: KVTransferConfig, identity: str, fail: Optional[str], report: ConnectorReport) -> None:
    sim = _Sim(cls, config, identity, fail)
    prefix = _tokens(1, 4 * BLOCK_SIZE)
    sim.add(prefix + _tokens(2, 3))
    sim.drain()
    sim.add(_tokens(3, 9 * BLOCK_SIZE + 2))  # takes 10 of the 12 blocks: the prefix's last blocks are evicted
    sim.drain()
    device_hits = len(sim.kv.get_computed_blocks(sim.add(prefix + _tokens(6, 3)))[0]) * BLOCK_SIZE
    _expect(device_hits < len(prefix), "set-up: the prefix should have left the device cache")
    step_hits = []  # (tokens counted computed at admission, after the loads ran) per request
    orig, seen = sim.rt.before_forward, set()

    def spy(out: Any) -> None:
        pre = {s.request.request_id: s.num_computed_tokens for s in out.scheduled}
        orig(out)
        for s in out.scheduled:
            if s.request.request_id not in seen:
                seen.add(s.request.request_id)
                step_hits.append((pre[s.request.request_id], s.num_computed_tokens))
    sim.rt.before_forward = spy
    sim.drain()
    _expect(sim.kv.num_used_blocks == 0, f"{sim.kv.num_used_blocks} device blocks still held after every request "
                                         "finished (leak)")
    _expect(not sim.kv.pending_load, "blocks left marked as loading after the step")
    if fail is None:
        report.loaded_tokens += sum(after for _, after in step_hits) - device_hits
    else:
        report.recomputed_requests += sum(1 for before, after in step_hits if after < before)
        _expect(all(after == device_hits for before, after in step_hits if before > device_hits),
                f"injected load failure ({fail}): core still counted loaded tokens as computed")


def check_connector(connector: Union[str, type], extra_config: Optional[dict] = None,
                    kv_role: str = "kv_both") -> ConnectorReport:
    """Run every check against ``connector`` (an entry-point name or a class); raises ConnectorCheckFailed."""
    cls = connector_class(connector) if isinstance(connector, str) else connector
    _expect(isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1),
            "a connector subclasses pagedllm.kv_transfer.KVConnectorBase_V1")
    report = ConnectorReport(cls.__name__)
    with tempfile.TemporaryDirectory(prefix="pagedllm-kvconn-") as tmp:
        extra = {k: (v.replace("{tmp}", tmp) if isinstance(v, str) else v) for k, v in (extra_config or {}).items()}
        config = KVTransferConfig(cls.__name__, kv_role, extra)
        identity = f"conformance-{cls.__name__}"

        sim = _Sim(cls, config, identity)
        req = sim.add(_tokens(9, 3 * BLOCK_SIZE + 1))
        got = sim.rt.scheduler_side.get_num_new_matched_tokens(req, 0)
        _expect(isinstance(got, tuple) and len(got) == 2 and (got[0] is None or isinstance(got[0], int))
                and isinstance(got[1], bool), f"get_num_new_matched_tokens returns (int | None, bool), got {got!r}")
        _expect(got[0] is None or (got[0] % BLOCK_SIZE == 0 and 0 <= got[0] < req.num_tokens),
                f"get_num_new_matched_tokens: whole blocks leaving one token to compute, got {got[0]}")
        _expect(not got[1], "load_async must be False: pagedllm loads before the step's forward")
        sim.rt.scheduler_side.update_state_after_alloc(req, [], 0)
        meta = sim.rt.scheduler_side.build_connector_meta(sim.sched.schedule())
        _expect(isinstance(meta, KVConnectorMetadata), f"build_connector_meta returns KVConnectorMetadata, got "
                                                       f"{type(meta).__name__}")
        fin = sim.rt.scheduler_side.request_finished(req, [])
        _expect(isinstance(fin, tuple) and len(fin) == 2 and isinstance(fin[0], bool)
                and (fin[1] is None or isinstance(fin[1], dict)),
                f"request_finished returns (bool, dict | None), got {fin!r}")
        report.checks.append("scheduler-side shapes")

        _scenario(cls, config, identity + "-a", None, report)
        report.checks.append("evicted prefix served with the right K/V, no leak")
        _scenario(cls, config, identity + "-b", "report", report)
        report.checks.append("reported load failures recomputed")
        _scenario(cls, config, identity + "-c", "raise", report)
        report.checks.append("raising start_load_kv recomputed")
    return report
