"""Connector conformance: drive a connector class through the whole contract with core's real scheduler, block
manager and reference copy ops, and check what it put in the device cache.

No model runs: a "forward" writes, at each token's slot, a value derived from the token and everything before it
(a rolling hash), so a block's correct K/V is known exactly; layer by layer it calls the step's per-layer hooks
around its read and write, as an attention layer does, and a request that read wrong K/V "samples" a wrong token.
After every step the check reads back every block a scheduled request counts as computed — device hits and
connector loads alike — checks the step's call order (each layer's ``wait_for_layer_load`` before its read,
``save_kv_layer`` after its write, once each; with the whole-model calls, around the forward) and that no request
that read wrong K/V keeps its token. Scenarios: a prefix evicted from the device pool and asked for again (the
connector may serve it), per layer and with the whole-model calls; loads reported as failed, a ``start_load_kv``
that raises and a load error found at a middle layer after the earlier layers read the blocks (core must recompute,
with the same tokens); finished requests whose blocks the connector keeps (``request_finished`` True) and must
release through ``get_finished``; and the return shapes of every scheduler-side call. ``check_connector`` returns a
report; a violation raises :class:`ConnectorCheckFailed`.

    python -c "from pagedllm.kv_transfer.conformance import check_connector; print(check_connector('MyConnector'))"
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from pagedllm.backend import ref_ops
from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.hookspec import KVCacheSpec
from pagedllm.kv_transfer.base import KVConnectorBase_V1, KVConnectorContext, KVConnectorMetadata, KVConnectorRole
from pagedllm.kv_transfer.config import KVTransferConfig
from pagedllm.kv_transfer.factory import connector_class
from pagedllm.kv_transfer.runtime import KVTransfer
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.kv_manager import KVCacheManager
from pagedllm.sched.request import Request, RequestStatus
from pagedllm.sched.scheduler import Scheduler

BLOCK_SIZE, NUM_BLOCKS, LAYERS, HEADS, HEAD_SIZE = 4, 12, 4, 2, 4  # 1 KiB blocks in float32
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
    """A scheduler, block manager and device caches with a model-free forward (see the module docstring). The sim
    plays the model runner too: with ``layerwise`` its forward calls the step's per-layer hooks around each layer's
    read and write, as an attention layer does; without, the runtime makes the whole-model calls."""

    def __init__(self, cls: type[KVConnectorBase_V1], config: KVTransferConfig, identity: str,
                 fail: Optional[str] = None, layerwise: bool = True):
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=True)
        self.sched = Scheduler(self.kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
        spec = KVCacheSpec(LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, torch.float32, torch.device("cpu"))
        self.caches = ref_ops.allocate_kv_cache(LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, torch.float32, "cpu")
        self.names = [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
        ctx = KVConnectorContext(
            model_identity=identity, block_size=BLOCK_SIZE, num_device_blocks=NUM_BLOCKS,
            bytes_per_block=spec.bytes_per_block, kv_spec=spec, layer_names=self.names,
            block_hashes=self.kv.block_hashes,
            allocate_host_kv_cache=lambda s, pin: ref_ops.allocate_kv_cache(
                s.num_layers, s.num_blocks, s.block_size, s.num_kv_heads, s.head_size, s.dtype, "cpu"),
            swap_kv_blocks=ref_ops.swap_kv_blocks, gather_kv_blocks=ref_ops.gather_kv_blocks)
        sched_side = cls(config, KVConnectorRole.SCHEDULER, ctx)
        worker_side = cls(config, KVConnectorRole.WORKER, ctx)
        self.fail = fail
        self.events: list[tuple[str, str]] = []  # this step's ("wait" | "read" | "write" | "save", layer name)
        self._record(worker_side)
        if fail == "report":  # every load of the step is reported as failed
            worker_side.get_block_ids_with_load_errors = lambda: set(self.kv.pending_load)
        elif fail == "raise":
            def boom(**kwargs: Any) -> None:
                raise RuntimeError("injected load failure")
            worker_side.start_load_kv = boom
        elif fail == "layer":  # found at the middle layer, after the earlier layers ran: its blocks hold garbage
            self._fail_at_layer(worker_side, self.names[LAYERS // 2])
        self.kv_connector: Any = None  # bound by the runtime for a step (the model runner's attribute)
        self.rt = KVTransfer(sched_side, worker_side, self.kv, dict(zip(self.names, self.caches)),
                             runner=(lambda: self) if layerwise else None)
        worker_side.register_kv_caches(self.rt.caches)
        self.sched.connector = self.rt
        self.kv.pool.on_evict = self.rt.on_evict
        self.requests: list[Request] = []
        self.first_steps: dict[str, tuple[int, int]] = {}  # request id -> (computed at admission, after its step)
        self.ids = 0

    def _record(self, w: KVConnectorBase_V1) -> None:
        wait, save = w.wait_for_layer_load, w.save_kv_layer

        def wait_for_layer_load(layer_name: str) -> None:
            self.events.append(("wait", layer_name))
            wait(layer_name)

        def save_kv_layer(layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            self.events.append(("save", layer_name))
            save(layer_name, kv_layer, attn_metadata, **kwargs)
        w.wait_for_layer_load, w.save_kv_layer = wait_for_layer_load, save_kv_layer

    def _fail_at_layer(self, w: KVConnectorBase_V1, layer_name: str) -> None:
        wait, errors = w.wait_for_layer_load, w.get_block_ids_with_load_errors
        failed: set[int] = set()
        layer = self.names.index(layer_name)

        def wait_for_layer_load(name: str) -> None:
            wait(name)
            if name == layer_name and self.kv.pending_load:
                failed.update(self.kv.pending_load)
                for cache in self.caches[layer:]:  # what a half-done transfer leaves
                    cache[:, sorted(failed)] = -7.0

        def get_block_ids_with_load_errors() -> set[int]:
            out = set(errors()) | failed
            failed.clear()
            return out
        w.wait_for_layer_load, w.get_block_ids_with_load_errors = wait_for_layer_load, get_block_ids_with_load_errors

    @staticmethod
    def value(tokens: list[int], p: int) -> float:
        r = 0
        for t in tokens[:p + 1]:
            r = (r * 1009 + t + 1) % MOD
        return float(r)

    @staticmethod
    def next_token(tokens: list[int]) -> int:
        """The token a forward that read right K/V samples (one that read wrong K/V samples 2, never this)."""
        return (tokens[-1] * 7 + 3) % 500 + 3

    def add(self, tokens: list[int], max_tokens: int = 2) -> Request:
        self.ids += 1
        req = Request(f"r{self.ids}", tokens, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)
        self.sched.add_request(req)
        self.requests.append(req)
        return req

    def _holds(self, layer: int, req: Request, p: int) -> bool:
        ids, cache = self.kv.block_ids(req.request_id), self.caches[layer]
        slot = (ids[p // BLOCK_SIZE], p % BLOCK_SIZE)
        want = self.value(req.all_token_ids, p)
        k, v = cache[0][slot].flatten()[0].item(), cache[1][slot].flatten()[0].item()
        return k == want + layer and v == -want - layer

    def _check_computed(self, out: Any) -> None:
        """After the step: every token a request counts as computed holds its prefix's K/V, in every layer."""
        for s in out.scheduled:
            req = s.request
            ids = self.kv.block_ids(req.request_id)
            for p in range(req.num_computed_tokens):
                for layer in range(LAYERS):
                    _expect(self._holds(layer, req, p),
                            f"request {req.request_id}: token {p} (block {ids[p // BLOCK_SIZE]}, layer {layer}) is "
                            "counted as computed but holds other K/V than its prefix's (a load wrote the wrong block, "
                            "or a failed load was not recomputed?)")

    def _forward(self, out: Any) -> set[str]:
        """Each layer: its hook's wait, the read of every computed token, the write of the new ones, its save.
        Returns the requests that read wrong K/V somewhere."""
        hooks = self.kv_connector
        meta = AttentionMetadata.build([s.num_new_tokens for s in out.scheduled],
                                       [s.num_computed_tokens + s.num_new_tokens for s in out.scheduled],
                                       [self.kv.block_ids(s.request.request_id) for s in out.scheduled], BLOCK_SIZE)
        if hooks is not None:
            meta.kv_connector = hooks
        wrong = set()
        for layer, (name, cache) in enumerate(zip(self.names, self.caches)):
            if hooks is not None:
                hooks.wait_for_layer_load(cache)
            self.events.append(("read", name))
            for s in out.scheduled:
                if not all(self._holds(layer, s.request, p) for p in range(s.num_computed_tokens)):
                    wrong.add(s.request.request_id)
            self.events.append(("write", name))
            for s in out.scheduled:
                req, ids = s.request, self.kv.block_ids(s.request.request_id)
                for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                    v = self.value(req.all_token_ids, p)
                    cache[0][ids[p // BLOCK_SIZE], p % BLOCK_SIZE] = v + layer
                    cache[1][ids[p // BLOCK_SIZE], p % BLOCK_SIZE] = -v - layer
            if hooks is not None:
                hooks.save_kv_layer(cache, meta)
        return wrong

    def _check_order(self, layerwise: bool) -> None:
        """This step's calls: each layer's wait before its read, its save after its write (per layer, or every wait
        before the forward and every save after it on the whole-model path), each exactly once."""
        ev = self.events
        for name in self.names:
            at = {k: [i for i, e in enumerate(ev) if e == (k, name)] for k in ("wait", "read", "write", "save")}
            # (after a connector raised, the step's remaining waits are skipped: its loads are recomputed anyway)
            _expect((len(at["wait"]) == 1 or (self.fail == "raise" and not at["wait"])) and len(at["save"]) == 1,
                    f"{name}: {len(at['wait'])} wait_for_layer_load and {len(at['save'])} save_kv_layer calls in one "
                    "step (one each)")
            if not at["wait"]:
                continue
            _expect(at["wait"][0] < at["read"][0] and at["save"][0] > at["write"][0],
                    f"{name}: wait_for_layer_load must come before the layer reads its cache and save_kv_layer after "
                    f"it wrote it; got {[e for e in ev if e[1] == name]}")
            if not layerwise:
                _expect(at["wait"][0] < min(i for i, e in enumerate(ev) if e[0] == "read")
                        and at["save"][0] > max(i for i, e in enumerate(ev) if e[0] == "write"),
                        "whole-model path: every wait before the forward, every save after it")
        if layerwise:  # the calls interleave with the forward: layer i's wait after layer i-1's read
            reads = [i for i, e in enumerate(ev) if e[0] == "read"][:len([e for e in ev if e[0] == "wait"])]
            waits = [i for i, e in enumerate(ev) if e[0] == "wait"]
            _expect(all(w > r for w, r in zip(waits[1:], reads)), "per-layer path: a layer's wait_for_layer_load "
                                                                   "came before the previous layer ran")

    def step(self) -> None:
        out = self.sched.schedule()
        self.events = []
        pre = {s.request.request_id: s.num_computed_tokens for s in out.scheduled}
        layerwise = self.rt.runner() is not None
        self.rt.before_forward(out)
        discarded: set[str] = set()
        wrong: set[str] = set()
        if out.scheduled:
            _expect(self.kv_connector is not None or not layerwise, "the runtime bound no per-layer hooks for an "
                                                                    "eager step")
            wrong = self._forward(out)
            discarded = self.rt.after_forward(out)
            _expect(self.kv_connector is None, "the step's per-layer hooks stayed bound after it")
            self._check_order(layerwise)
            _expect(wrong <= discarded, f"requests {sorted(wrong - discarded)} read K/V their loads did not fill "
                                        "and their step was not discarded (a wrong token would be emitted)")
        for s in out.scheduled:
            self.first_steps.setdefault(s.request.request_id, (pre[s.request.request_id], s.num_computed_tokens))
        self.sched.update(out)
        self._check_computed(out)
        for s in out.scheduled:
            req = s.request
            if s.samples and not req.is_finished and req.request_id not in discarded:
                req.append_token(self.next_token(req.all_token_ids) if req.request_id not in wrong else 2)
                if req.num_output_tokens >= req.max_tokens:
                    self.sched.finish(req, RequestStatus.FINISHED_LENGTH)

    def drain(self, limit: int = 200) -> None:
        for _ in range(limit):
            if not self.sched.has_unfinished() and not self.rt.has_pending():
                return
            self.step()
        raise ConnectorCheckFailed(f"requests or kept blocks still pending after {limit} steps (get_finished never "
                                   "reported a request whose request_finished returned True?)")

    def check_tokens(self) -> None:
        """Every request's output is what a run with right K/V samples: identical greedy tokens."""
        for req in self.requests:
            want = list(req.prompt_token_ids)
            for _ in range(req.num_output_tokens):
                want.append(self.next_token(want))
            _expect(list(req.all_token_ids) == want, f"request {req.request_id}: output tokens "
                                                     f"{req.output_token_ids} differ from a run without the connector")


def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def _scenario(cls: type, config: KVTransferConfig, identity: str, fail: Optional[str], report: ConnectorReport,
              layerwise: bool = True) -> None:
    sim = _Sim(cls, config, identity, fail, layerwise)
    prefix = _tokens(1, 4 * BLOCK_SIZE)
    sim.add(prefix + _tokens(2, 3))
    sim.drain()
    sim.add(_tokens(3, 9 * BLOCK_SIZE + 2))  # takes 10 of the 12 blocks: the prefix's last blocks are evicted
    sim.drain()
    late = sim.add(prefix + _tokens(6, 3))
    device_hits = len(sim.kv.get_computed_blocks(late)[0]) * BLOCK_SIZE
    _expect(device_hits < len(prefix), "set-up: the prefix should have left the device cache")
    sim.drain()
    _expect(sim.kv.num_used_blocks == 0, f"{sim.kv.num_used_blocks} device blocks still held after every request "
                                         "finished (leak)")
    _expect(not sim.kv.pending_load, "blocks left marked as loading after the step")
    sim.check_tokens()
    before, after = sim.first_steps[late.request_id]
    if fail is None:
        report.loaded_tokens += after - device_hits
    else:
        report.recomputed_requests += int(after < before)
        _expect(before <= device_hits or after == device_hits,
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
        _scenario(cls, config, identity + "-w", None, report, layerwise=False)
        report.checks.append("evicted prefix served with the right K/V, no leak")
        report.checks.append("per-layer calls in order (each layer's wait before its read, save after its write), "
                             "whole-model calls around the forward")
        _scenario(cls, config, identity + "-b", "report", report)
        report.checks.append("reported load failures recomputed")
        _scenario(cls, config, identity + "-c", "raise", report)
        report.checks.append("raising start_load_kv recomputed")
        _scenario(cls, config, identity + "-d", "layer", report)
        report.checks.append("load error found at a middle layer recomputed, same tokens")
    return report
