"""Recurrent-state op checks (Mamba2, Gated DeltaNet) against ``pagedllm.backend.ssm_ops`` / ``delta_rule_ops``.

Each prefill op on a varlen batch mixing fresh sequences (zero initial state) and continuing ones (a random
state), followed by padding rows; each prefill op run over the same sequences cut into several calls with its own
final states carried into the next call, against one reference call over the whole sequences (a backend that drops
or misreads the initial state fails here); each decode op on a state cache with shuffled slots, untouched slots and
a padding row; and each decode op applied token by token against the reference prefill op over the whole
sequences (the decode and prefill paths of one model must agree)."""

from __future__ import annotations

from typing import Callable

import torch

from pagedllm.backend import delta_rule_ops, ssm_ops
from pagedllm.conformance.harness import CaseContext, CheckFailed, poison_allocator

#: Sequence lengths of the varlen batches (one token, several chunks, one chunk exactly, short) and which of them
#: continue from a state (the others start fresh); padding rows follow them.
LENGTHS, CONTINUING, PADDING = (1, 13, 40, 16, 6), (False, True, True, False, True), 5
#: Where each sequence is cut for the several-calls checks (fractions of its length; a piece may be empty, and then
#: the sequence sits that call out, as a finished prefill does).
CUTS = (0.3, 0.75)
MAMBA = dict(heads=4, head_dim=8, groups=2, d_state=16, chunk_size=8)
DELTA = dict(heads=2, v_heads=4, k_dim=16, v_dim=8)
NUM_SLOTS = 9


def _cu(ctx: CaseContext, lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=ctx.device)


def _initial(ctx: CaseContext, shape: tuple, scale: float) -> torch.Tensor:
    """float32 ``[N, *shape]``: a random state for each continuing sequence, zeros for each fresh one."""
    return torch.stack([ctx.randn(*shape, dtype=torch.float32, scale=scale) if c
                        else torch.zeros(shape, device=ctx.device) for c in CONTINUING])


def _token_where(lengths) -> Callable[[tuple], str]:
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]

    def where(idx: tuple) -> str:
        for i in range(len(lengths)):
            if bounds[i] <= idx[0] < bounds[i + 1]:
                kind = "continuing" if CONTINUING[i] else "fresh"
                return f"sequence {i} ({kind}, length {lengths[i]}), token {idx[0] - bounds[i]}, head {idx[1]}"
        return f"row {idx[0]}"

    return where


def _state_where(idx: tuple) -> str:
    i = idx[0]
    return f"sequence {i} ({'continuing' if CONTINUING[i] else 'fresh'}, length {LENGTHS[i]}), head {idx[1]}"


def _pieces(lengths) -> list[list[tuple[int, int]]]:
    """For each call, each sequence's ``(start, end)`` inside it (maybe empty)."""
    cuts = [[0, *(int(len_ * f) for f in CUTS), len_] for len_ in lengths]
    return [[(c[j], c[j + 1]) for c in cuts] for j in range(len(CUTS) + 1)]


def _rows(lengths, spans) -> torch.Tensor:
    """Flat token rows of the whole batch that the spans (one per sequence) select, in order."""
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    return torch.tensor([bounds[i] + t for i, (a, b) in enumerate(spans) for t in range(a, b)], dtype=torch.long)


def _carried(ctx: CaseContext, run: Callable, tensors: list, init: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``run(*pieces, cu_seqlens, initial_states)`` over the batch cut into calls, each sequence's final state
    carried into its next call (sequences without tokens in a call sit it out); returns the outputs in whole-batch
    token order and the last final states."""
    state, out = init.clone(), None
    for spans in _pieces(LENGTHS):
        active = [i for i, (a, b) in enumerate(spans) if b > a]
        rows = _rows(LENGTHS, spans).to(ctx.device)
        o, finals = run(*(t[rows] for t in tensors), _cu(ctx, [spans[i][1] - spans[i][0] for i in active]),
                        state[active].contiguous())
        if out is None:
            out = torch.full((sum(LENGTHS), *o.shape[1:]), float("nan"), dtype=o.dtype, device=o.device)
        out[rows], state[active] = o, finals.float()
    return out, state


def _check_result(ctx: CaseContext, got, ref: tuple, what: str, state_what: str) -> None:
    if not isinstance(got, tuple) or len(got) != 2:
        raise CheckFailed(f"{what}: expected (output, final states), got {type(got).__name__}")
    total = sum(LENGTHS)
    ctx.compare(got[0][:total], ref[0][:total], f"{what} output", where=_token_where(LENGTHS))
    ctx.compare(got[1], ref[1], f"{what} {state_what}", where=_state_where)


# ---- Mamba2 ----------------------------------------------------------------------------------------------------
def _mamba_inputs(ctx: CaseContext, tokens: int) -> dict:
    """``decay`` (param) scales ``A``: strong decays drive a chunk's log decays far below -80 (denormal range)."""
    h, p, g, n = (MAMBA[k] for k in ("heads", "head_dim", "groups", "d_state"))
    a = -(torch.rand(h, generator=ctx.gen) + 0.5) * ctx.params.get("decay", 1.0)
    return dict(x=ctx.randn(tokens, h, p), dt=ctx.randn(tokens, h, scale=0.5),
                A=a.to(ctx.device), B=ctx.randn(tokens, g, n, scale=0.5),
                C=ctx.randn(tokens, g, n, scale=0.5), D=ctx.randn(h), z=ctx.randn(tokens, h, p),
                dt_bias=ctx.randn(h, scale=0.5))


def _mamba_state_shape() -> tuple:
    return MAMBA["heads"], MAMBA["head_dim"], MAMBA["d_state"]


def check_mamba_chunk_scan(ctx: CaseContext) -> None:
    """``mamba_chunk_scan_combined`` on the varlen batch (``scenario="varlen"``; ``fresh_only``: no initial states at
    all), or cut into calls with the state carried (``scenario="carried"``), against one reference call."""
    total, limit = sum(LENGTHS), ctx.params.get("dt_limit", (0.0, float("inf")))
    chunk = ctx.params.get("chunk_size", MAMBA["chunk_size"])
    inp = _mamba_inputs(ctx, total + PADDING)
    init = None if ctx.params.get("fresh_only") else _initial(ctx, _mamba_state_shape(), 0.5)
    cu = _cu(ctx, LENGTHS)
    a, d, z, bias = inp["A"], inp["D"], inp["z"], inp["dt_bias"]
    ref = ssm_ops.mamba_chunk_scan_combined(inp["x"], inp["dt"], a, inp["B"], inp["C"], chunk, cu, init, d, z,
                                            bias, True, limit)
    if ctx.params["scenario"] == "varlen":
        poison_allocator(inp["x"].numel(), ctx.dtype, ctx.device)
        got = ctx.backend.mamba_chunk_scan_combined(inp["x"], inp["dt"], a, inp["B"], inp["C"], chunk, cu, init, d,
                                                    z, bias, True, limit)
        _check_result(ctx, got, ref, "mamba_chunk_scan_combined", "final states")
        return

    def run(x, dt, b, c, z_, cu_, state):
        return ctx.backend.mamba_chunk_scan_combined(x, dt, a, b, c, chunk, cu_, state, d, z_, bias, True, limit)

    got = _carried(ctx, run, [inp[k][:total] for k in ("x", "dt", "B", "C", "z")], init)
    _check_result(ctx, got, ref, "mamba_chunk_scan_combined over 3 calls, state carried,",
                  "final states after the last call")


def check_selective_state_update(ctx: CaseContext) -> None:
    """``scenario="decode"``: one step on a state cache with shuffled slots, untouched slots and a padding row,
    against the reference (outputs, then the whole cache). ``scenario="vs_chunk_scan"``: the varlen batch token by
    token, each sequence in its own slot, against the reference chunk scan over the whole sequences."""
    shape = _mamba_state_shape()
    if ctx.params["scenario"] == "decode":
        batch = 6
        inp = _mamba_inputs(ctx, batch)
        slots = ctx.randperm(NUM_SLOTS)[:batch]
        slots[2] = -1  # a padding row
        idx = torch.tensor(slots, dtype=torch.int32, device=ctx.device)
        state = ctx.randn(NUM_SLOTS, *shape, scale=0.5)  # a cache in the model dtype (vLLM's default)
        ref_state = state.clone()
        args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"], inp["dt_bias"], True, idx)
        ref = ssm_ops.selective_state_update(ref_state, *args)
        poison_allocator(inp["x"].numel(), ctx.dtype, ctx.device)
        out = ctx.backend.selective_state_update(state, *args)
        real = [i for i, s in enumerate(slots) if s >= 0]
        ctx.compare(out[real] if isinstance(out, torch.Tensor) else out, ref[real],
                    "selective_state_update output (padding row excluded)")
        ctx.compare(state, ref_state, "selective_state_update state cache (untouched slots must keep their values)",
                    where=lambda i: f"slot {i[0]} ({'row ' + str(slots.index(i[0])) if i[0] in slots else 'untouched'})"
                                    f", head {i[1]}")
        return
    total = sum(LENGTHS)
    inp = _mamba_inputs(ctx, total)
    init = _initial(ctx, shape, 0.5)
    ref = ssm_ops.mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], MAMBA["chunk_size"],
                                            _cu(ctx, LENGTHS), init, inp["D"], inp["z"], inp["dt_bias"], True)

    def step(rows, slot_idx, state):
        return ctx.backend.selective_state_update(state, inp["x"][rows], inp["dt"][rows], inp["A"], inp["B"][rows],
                                                  inp["C"][rows], inp["D"], inp["z"][rows], inp["dt_bias"], True,
                                                  slot_idx)

    got = _token_by_token(ctx, step, init)
    _check_result(ctx, got, ref, "selective_state_update token by token", "states after the last token")


def _token_by_token(ctx: CaseContext, step: Callable, init: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode every sequence of :data:`LENGTHS` one token per call (sequences in reversed slots, finished ones left
    out), from ``init``; returns the outputs in token order and each sequence's final state."""
    bounds = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    slots = list(range(len(LENGTHS)))[::-1]
    state = torch.zeros(NUM_SLOTS, *init.shape[1:], device=ctx.device)
    state[slots] = init
    out = None
    for t in range(max(LENGTHS)):
        live = [i for i in range(len(LENGTHS)) if t < LENGTHS[i]]
        rows = torch.tensor([bounds[i] + t for i in live], dtype=torch.long, device=ctx.device)
        o = step(rows, torch.tensor([slots[i] for i in live], dtype=torch.int32, device=ctx.device), state)
        if out is None:
            out = torch.full((sum(LENGTHS), *o.shape[1:]), float("nan"), dtype=o.dtype, device=o.device)
        out[rows] = o
    return out, state[slots]


# ---- Gated DeltaNet ------------------------------------------------------------------------------------------------
def _delta_inputs(ctx: CaseContext, tokens: int, l2norm: bool) -> dict:
    h, hv, k, v = (DELTA[x] for x in ("heads", "v_heads", "k_dim", "v_dim"))
    q, key = ctx.randn(tokens, h, k), ctx.randn(tokens, h, k)
    if not l2norm:  # without the kernel's normalisation, unit keys keep the delta rule stable (as models feed it)
        key = delta_rule_ops.l2norm(key).to(ctx.dtype)
    g = -torch.nn.functional.softplus(ctx.randn(tokens, hv, dtype=torch.float32)) * 0.5 * ctx.params.get("decay", 1)
    beta = torch.sigmoid(ctx.randn(tokens, hv, dtype=torch.float32)).to(ctx.dtype)
    return dict(q=q, k=key, v=ctx.randn(tokens, hv, v), g=g, beta=beta)


def _delta_state_shape() -> tuple:
    return DELTA["v_heads"], DELTA["k_dim"], DELTA["v_dim"]


def check_chunk_gated_delta_rule(ctx: CaseContext) -> None:
    """``chunk_gated_delta_rule`` on the varlen batch (``scenario="varlen"``) or cut into calls with the state
    carried (``scenario="carried"``), against one reference call; ``l2norm``: the kernel normalises q and k."""
    total, l2 = sum(LENGTHS), ctx.params["l2norm"]
    inp = _delta_inputs(ctx, total + PADDING, l2)
    init = None if ctx.params.get("fresh_only") else _initial(ctx, _delta_state_shape(), 0.5)
    cu, scale = _cu(ctx, LENGTHS), ctx.params.get("scale")
    ref = delta_rule_ops.chunk_gated_delta_rule(*(inp[k] for k in ("q", "k", "v", "g", "beta")), init, cu, scale, l2)
    if ctx.params["scenario"] == "varlen":
        poison_allocator(inp["v"].numel(), ctx.dtype, ctx.device)
        got = ctx.backend.chunk_gated_delta_rule(*(inp[k] for k in ("q", "k", "v", "g", "beta")), scale, init, cu, l2)
        _check_result(ctx, got, ref, "chunk_gated_delta_rule", "final states")
        return

    def run(q, k, v, g, beta, cu_, state):
        return ctx.backend.chunk_gated_delta_rule(q, k, v, g, beta, scale, state, cu_, l2)

    got = _carried(ctx, run, [inp[k][:total] for k in ("q", "k", "v", "g", "beta")], init)
    _check_result(ctx, got, ref, "chunk_gated_delta_rule over 3 calls, state carried,",
                  "final states after the last call")


def check_fused_recurrent_gated_delta_rule(ctx: CaseContext) -> None:
    """As :func:`check_selective_state_update`, for ``fused_recurrent_gated_delta_rule`` against the reference
    ``chunk_gated_delta_rule`` (``l2norm``: the kernel normalises q and k)."""
    l2, shape, scale = ctx.params["l2norm"], _delta_state_shape(), ctx.params.get("scale")
    if ctx.params["scenario"] == "decode":
        batch = 6
        inp = _delta_inputs(ctx, batch, l2)
        slots = ctx.randperm(NUM_SLOTS)[:batch]
        slots[2] = -1
        idx = torch.tensor(slots, dtype=torch.int32, device=ctx.device)
        state = ctx.randn(NUM_SLOTS, *shape, scale=0.5)  # a cache in the model dtype (vLLM's default)
        ref_state = state.clone()
        qkvgb = [inp[k] for k in ("q", "k", "v", "g", "beta")]
        ref = delta_rule_ops.fused_recurrent_gated_delta_rule(*qkvgb, ref_state, idx, scale, l2)
        poison_allocator(inp["v"].numel(), ctx.dtype, ctx.device)
        out = ctx.backend.fused_recurrent_gated_delta_rule(*qkvgb, scale, state, idx, l2)
        real = [i for i, s in enumerate(slots) if s >= 0]
        ctx.compare(out[real] if isinstance(out, torch.Tensor) else out, ref[real],
                    "fused_recurrent_gated_delta_rule output (padding row excluded)")
        ctx.compare(state, ref_state, "fused_recurrent_gated_delta_rule state cache (untouched slots must keep "
                    "their values)", where=lambda i: f"slot {i[0]}, head {i[1]}")
        return
    total = sum(LENGTHS)
    inp = _delta_inputs(ctx, total, l2)
    init = _initial(ctx, shape, 0.5)
    qkvgb = [inp[k] for k in ("q", "k", "v", "g", "beta")]
    ref = delta_rule_ops.chunk_gated_delta_rule(*qkvgb, init, _cu(ctx, LENGTHS), scale, l2)

    def step(rows, slot_idx, state):
        return ctx.backend.fused_recurrent_gated_delta_rule(*(t[rows] for t in qkvgb), scale, state, slot_idx, l2)

    got = _token_by_token(ctx, step, init)
    _check_result(ctx, got, ref, "fused_recurrent_gated_delta_rule token by token", "states after the last token")


#: The hooks each check exercises (for the runner's reference-fallback accounting).
CHECK_HOOKS = {
    check_mamba_chunk_scan: ("pagedllm_mamba_chunk_scan_combined",),
    check_selective_state_update: ("pagedllm_selective_state_update",),
    check_chunk_gated_delta_rule: ("pagedllm_chunk_gated_delta_rule",),
    check_fused_recurrent_gated_delta_rule: ("pagedllm_fused_recurrent_gated_delta_rule",),
}


def cases() -> list[tuple[str, str, Callable[[CaseContext], None], dict]]:
    """``(kernel, model, check, params)`` per case, for every declared dtype."""
    m = "h{heads}-p{head_dim}-g{groups}-n{d_state}-chunk{chunk_size}".format(**MAMBA)
    d = "h{heads}-hv{v_heads}-k{k_dim}-v{v_dim}".format(**DELTA)
    out = [("mamba_chunk_scan_combined.varlen", m, check_mamba_chunk_scan, dict(scenario="varlen")),
           ("mamba_chunk_scan_combined.fresh", m, check_mamba_chunk_scan, dict(scenario="varlen", fresh_only=True)),
           ("mamba_chunk_scan_combined.dt_limit", m, check_mamba_chunk_scan,
            dict(scenario="varlen", dt_limit=(0.3, 0.9))),
           ("mamba_chunk_scan_combined.state_carried", m, check_mamba_chunk_scan, dict(scenario="carried")),
           ("mamba_chunk_scan_combined.strong_decay", m.replace("chunk8", "chunk32"), check_mamba_chunk_scan,
            dict(scenario="varlen", decay=8.0, chunk_size=32)),
           ("selective_state_update.decode", m, check_selective_state_update, dict(scenario="decode")),
           ("selective_state_update.vs_chunk_scan", m, check_selective_state_update, dict(scenario="vs_chunk_scan"))]
    for l2 in (True, False):
        tag = "-l2norm" if l2 else ""
        out += [("chunk_gated_delta_rule.varlen", d + tag, check_chunk_gated_delta_rule,
                 dict(scenario="varlen", l2norm=l2)),
                ("chunk_gated_delta_rule.state_carried", d + tag, check_chunk_gated_delta_rule,
                 dict(scenario="carried", l2norm=l2)),
                ("fused_recurrent_gated_delta_rule.decode", d + tag, check_fused_recurrent_gated_delta_rule,
                 dict(scenario="decode", l2norm=l2)),
                ("fused_recurrent_gated_delta_rule.vs_chunked", d + tag, check_fused_recurrent_gated_delta_rule,
                 dict(scenario="vs_chunked", l2norm=l2))]
    out += [("chunk_gated_delta_rule.fresh", d + "-l2norm-scale0.3", check_chunk_gated_delta_rule,
             dict(scenario="varlen", l2norm=True, fresh_only=True, scale=0.3)),
            ("chunk_gated_delta_rule.strong_decay", d + "-l2norm", check_chunk_gated_delta_rule,
             dict(scenario="varlen", l2norm=True, decay=16.0))]
    return out
