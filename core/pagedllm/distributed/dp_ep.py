"""Expert parallel across data-parallel replicas (vLLM's DP+EP, ``--data-parallel-size N --enable-expert-parallel``).

Each of the N replica engines (``entrypoints/dp_client.py``) holds the attention and dense parts whole and experts
``[start, end)`` of every MoE layer (an even split, the remainder to the first replicas). An MoE layer then needs
every replica's tokens, so the replicas run their forwards in lock step and exchange tokens in every MoE layer with
vLLM's "naive" all-to-all: all-gather the hidden states and router outputs of every replica (token counts differ:
each forward's first MoE layer gathers the counts, the tensors are padded to the largest), run the local experts on
all tokens (routes to other replicas' experts weighted 0), all-reduce the partial outputs and keep this replica's
rows. A replica with no requests runs a dummy forward (its MoE layers with 0 tokens) whenever another one steps
(:class:`LockStep`, driven by ``entrypoints/dp_lockstep.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from pagedllm.distributed.binding import local_device
from pagedllm.distributed.communicator import TorchCommunicator, init_world
from pagedllm.distributed.parallel_state import STARTUP_TIMEOUT_S
from pagedllm.errors import ParamError


@dataclass(frozen=True)
class DPEPConfig:
    """What one replica needs to join the others: its rank, the group size and the rendezvous address."""

    dp_rank: int
    dp_size: int
    init_method: str  # tcp://host:port of the replicas' torch.distributed world
    timeout_s: float = 300.0  # the longest any exchange waits for a peer (start-up: max(this, 600 s))


def expert_share(num_experts: int, dp_size: int, dp_rank: int) -> tuple[int, int]:
    """Experts ``[start, end)`` of replica ``dp_rank``: an even split, the remainder to the first replicas."""
    base, extra = divmod(num_experts, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return start, start + base + (dp_rank < extra)


def num_routed_experts(hf_config: Any) -> int:
    return (getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None)
            or getattr(hf_config, "n_routed_experts", None) or 0)


def check_dp_ep(hf_config: Any, config: Any, dp_size: int) -> None:
    """Refuse, naming the field, what DP+EP does not run: a dense model, fewer experts than replicas, and the
    features a replica of a DP+EP group does not combine with yet."""
    n = num_routed_experts(hf_config)
    if not n:
        raise ParamError("enable_expert_parallel", "needs a mixture-of-experts model (this one has no experts)")
    if n < dp_size:
        raise ParamError("data_parallel_size", f"{dp_size} replicas for {n} experts: each replica needs one")
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        raise ParamError("enable_expert_parallel", "with data_parallel_size > 1 runs one rank per replica "
                                                   "(tensor_parallel_size = pipeline_parallel_size = 1) here")
    for name, on in (("enable_lora", config.enable_lora), ("speculative_config", config.speculative_config),
                     ("quantization", config.quantization not in (None, "none")),
                     ("model_impl", config.model_impl == "transformers")):
        if on:
            raise ParamError(name, "is not supported with data_parallel_size > 1 and enable_expert_parallel yet")


class DPEPState:
    """This replica's place in the group: the communicators, its expert share and the lock-step counters."""

    def __init__(self, cfg: DPEPConfig, comm: Any, control: Any):
        self.cfg, self.comm, self.control = cfg, comm, control  # control: host-side gloo (per-step flags)
        self.rank, self.size = cfg.dp_rank, cfg.dp_size
        self.moe_layers: list[nn.Module] = []  # this replica's MoE blocks, in layer order
        self.experts: tuple[int, int, int] = (0, 0, 0)  # (start, end, total)
        self.active = False  # inside a lock-step forward: MoE layers exchange tokens
        self.moe_calls = 0  # MoE layer calls that exchanged (a forward makes len(moe_layers))
        self.sizes: list[int] = []  # every replica's token count in the current forward
        self.wave = 0  # lock-step waves completed (identical on every replica: waves end together)
        self.steps = 0  # lock-step iterations that ran a forward (equal on every replica)
        self.dummy_steps = 0  # of which this replica ran a dummy forward (no requests of its own)


_STATE: Optional[DPEPState] = None


def get_dp_ep_state() -> Optional[DPEPState]:
    """This process's DP+EP state, or None outside a DP+EP replica."""
    return _STATE


def init_dp_ep(cfg: DPEPConfig, backend: Any) -> DPEPState:
    """Join the replicas' world (blocks until every replica arrived) and make the data communicator (the backend's
    collective library, through ``pagedllm_communicator``) and the host-side gloo one for the per-step flags."""
    global _STATE
    device = local_device(backend, cfg.dp_rank)  # the replica's own device where devices are indexed
    backend.set_device(device)
    init_world(cfg.dp_rank, cfg.dp_size, cfg.init_method, "gloo", max(cfg.timeout_s, STARTUP_TIMEOUT_S))
    ranks = list(range(cfg.dp_size))
    comm = backend.communicator(ranks, device, backend.distributed_backend(), cfg.timeout_s)
    control = TorchCommunicator(ranks, torch.device("cpu"), cfg.timeout_s, "gloo")
    _STATE = DPEPState(cfg, comm, control)
    return _STATE


def shard_experts(model: nn.Module, state: DPEPState) -> None:
    """Give every MoE block (built on the meta device) this replica's experts only and the exchanging
    ``fused_moe``; the router and any shared expert stay whole."""
    for layer in getattr(model, "layers", []):
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not hasattr(mlp, "w13"):
            continue
        total = mlp.w13.shape[0]
        e0, e1 = expert_share(total, state.size, state.rank)
        mlp.w13 = nn.Parameter(torch.empty(e1 - e0, *mlp.w13.shape[1:], device="meta"), requires_grad=False)
        mlp.w2 = nn.Parameter(torch.empty(e1 - e0, *mlp.w2.shape[1:], device="meta"), requires_grad=False)
        mlp.fused_moe = ExpertExchange(mlp.fused_moe, e0, e1 - e0, len(state.moe_layers), state)
        state.moe_layers.append(mlp)
        state.experts = (e0, e1, total)


def shard_expert_weights(sd: dict[str, torch.Tensor], state: DPEPState) -> dict[str, torch.Tensor]:
    """Slice the stacked ``mlp.w13`` / ``mlp.w2`` of ``sd`` to this replica's experts (a copy: the full ones go)."""
    out = {}
    for key, t in sd.items():
        if key.endswith((".mlp.w13", ".mlp.w2")):
            e0, e1 = expert_share(t.shape[0], state.size, state.rank)
            t = t[e0:e1].contiguous().clone()
        out[key] = t
    return out


class ExpertExchange:
    """Replaces an MoE block's ``fused_moe``: the naive all-to-all over the replicas (module docstring). Outside a
    lock-step forward (warm-up and profiling forwards, whose output is discarded) it runs the local experts on the
    local tokens only, so start-up needs no peer."""

    def __init__(self, fused_moe: Any, start: int, num_local: int, ordinal: int, state: DPEPState):
        self.fused_moe, self.start, self.num_local, self.ordinal, self.state = (fused_moe, start, num_local,
                                                                                ordinal, state)

    def _local(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
               ids: torch.Tensor) -> torch.Tensor:
        """This replica's experts' share of every route (routes elsewhere: weight 0 on local expert 0)."""
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        return self.fused_moe(x, w13, w2, weights.masked_fill(outside, 0), local.masked_fill(outside, 0))

    def __call__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        st = self.state
        if not st.active:
            return self._local(x, w13, w2, topk_weights, topk_ids) if x.shape[0] else x.new_zeros(x.shape)
        st.moe_calls += 1
        comm, n = st.comm, x.shape[0]
        if self.ordinal == 0:  # the counts are the same in every MoE layer of one forward
            st.sizes = comm.all_gather(torch.tensor([n], dtype=torch.int64, device=x.device), dim=0).tolist()
        sizes = st.sizes
        most, total = max(sizes), sum(sizes)
        if total == 0:
            return x.new_zeros(x.shape)
        k, h = topk_ids.shape[1], x.shape[1]
        # One gather per layer: each row is the hidden state, then the router's float32 weights and expert ids
        # (exact below 2**24) reinterpreted bit for bit as the hidden dtype.
        routes = torch.cat([topk_weights.float(), topk_ids.float()], dim=1)
        rows = torch.cat([x, routes.view(x.dtype)], dim=1)
        if n < most:
            rows = torch.cat([rows, rows.new_zeros(most - n, rows.shape[1])])
        gathered = comm.all_gather(rows, dim=0)
        if total < most * st.size:  # drop the padding rows before the experts see them
            keep = torch.cat([torch.arange(i * most, i * most + s, device=x.device) for i, s in enumerate(sizes)])
            gathered = gathered.index_select(0, keep)
        xs, rs = gathered[:, :h].contiguous(), gathered[:, h:].contiguous().view(torch.float32)
        out = self._local(xs, w13, w2, rs[:, :k].to(topk_weights.dtype), rs[:, k:].long())
        comm.all_reduce(out)  # every replica's experts summed (gloo has no reduce-scatter)
        first = sum(sizes[:st.rank])
        return out[first:first + n]


class LockStep:
    """The per-iteration protocol of a DP+EP replica (vLLM's DP engine loop): every replica all-reduces
    (has work, stopping) each iteration; while any has work every replica runs exactly one forward, its own step or
    a dummy one; all go idle together when none has work, all stop together when any stops."""

    def __init__(self, state: DPEPState):
        self.state = state

    def sync(self, has_work: bool, stopping: bool) -> tuple[bool, bool]:
        t = torch.tensor([int(has_work), int(stopping)], dtype=torch.int64)
        self.state.control.all_reduce(t)
        return bool(t[0]), bool(t[1])

    def step(self, engine: Any) -> list:
        """This replica's forward of a lock-step iteration: its engine's step if it has requests (a step that
        schedules nothing, e.g. waiting on a grammar, is topped up with a dummy), else a dummy forward."""
        st = self.state
        calls = st.moe_calls
        st.active = True
        try:
            outputs = engine.step() if engine.has_unfinished_requests() else []
            ran = st.moe_calls - calls
            if ran == 0:
                self.dummy_forward()
                st.dummy_steps += 1
            elif ran != len(st.moe_layers):
                raise RuntimeError(f"DP+EP: a step ran {ran} MoE layer calls, not one forward's "
                                   f"{len(st.moe_layers)}; the replicas would fall out of lock step")
        finally:
            st.active = False
        st.steps += 1
        return outputs

    @torch.inference_mode()
    def dummy_forward(self) -> None:
        """vLLM's ``execute_dummy_batch``: the MoE layers with 0 tokens, so the other replicas' tokens meet this
        replica's experts (attention and dense layers are local and need no dummy)."""
        for mlp in self.state.moe_layers:
            mlp(mlp.w13.new_empty(0, mlp.w13.shape[2]))
