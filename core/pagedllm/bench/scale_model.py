"""``pagedllm bench scale-model``: projected step time of Llama-3-70B under TP=8 and TP=8 x PP=2, by calculation.

Why a calculator: the machine here has two CPU cores and no interconnect, so multi-GPU / multi-node numbers can only
be projected. Inputs are of two kinds, and the output says which is which:

* measured here: one tensor-parallel rank's share of a 70B layer (its four GEMMs at the TP shard shapes, fp32, one
  thread) timed on this CPU for several token counts;
* datasheet figures (:class:`Links`, :data:`H100`): NVLink 4 900 GB/s bidirectional per GPU (450 GB/s each way),
  all-reduce latency 10-30 us (20 us used), InfiniBand NDR 400 Gb/s per port (50 GB/s), H100 SXM dense bf16
  989 TFLOP/s and HBM3 3.35 TB/s.

Model (no overlap of compute and communication, so the communication share is an upper bound): per layer each rank
runs 1/tp of the GEMMs and heads, then two all-reduces of the activations (after o_proj and down_proj; ring
all-reduce: latency + 2 (p-1)/p bytes / link bandwidth); per step one all-reduce after the vocab-parallel embedding
and one all-gather of the logits; pipeline stages pass the activations over InfiniBand. A device's compute time is
the roofline ``max(FLOPs / peak, bytes / memory bandwidth)`` for the datasheet GPU, and the measured time (linear
in tokens beyond the largest measured count) for this CPU.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

BF16 = 2  # bytes per weight / activation on the projected GPUs


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    def layer_params(self) -> int:
        """Weights of one decoder layer's four GEMMs (qkv, o, gate_up, down)."""
        qkv = self.hidden * (self.q_heads + 2 * self.kv_heads) * self.head_dim
        o = self.q_heads * self.head_dim * self.hidden
        return qkv + o + 3 * self.hidden * self.ffn

    def shard_shapes(self, tp: int) -> list[tuple[int, int]]:
        """(in, out) of one rank's GEMMs: column-parallel qkv and gate_up, row-parallel o and down (kv heads
        replicated when there are fewer than ranks)."""
        kv = max(self.kv_heads // tp, 1)
        q = self.q_heads // tp
        return [(self.hidden, (q + 2 * kv) * self.head_dim), (q * self.head_dim, self.hidden),
                (self.hidden, 2 * self.ffn // tp), (self.ffn // tp, self.hidden)]


#: Llama-3-70B (config.json of meta-llama/Meta-Llama-3-70B).
LLAMA3_70B = ModelShape(layers=80, hidden=8192, q_heads=64, kv_heads=8, head_dim=128, ffn=28672, vocab=128256)


@dataclass(frozen=True)
class Links:
    """Datasheet figures (bytes/s one way, seconds)."""
    nvlink_bw: float = 450e9  # NVLink 4 on H100 SXM: 900 GB/s bidirectional per GPU
    allreduce_latency: float = 20e-6  # all-reduce / all-gather latency, 10-30 us for small messages
    ib_bw: float = 50e9  # InfiniBand NDR: 400 Gb/s per port
    ib_latency: float = 10e-6  # collective send/recv over IB, small message (assumed; NDR port-to-port is ~1 us)


@dataclass(frozen=True)
class Device:
    """A rank's compute: ``time(flops, bytes, tokens)`` -> seconds for one layer's share."""
    name: str
    time: Callable[[float, float, int], float]


def roofline(name: str, flops_per_s: float, bytes_per_s: float) -> Device:
    return Device(name, lambda flops, nbytes, tokens: max(flops / flops_per_s, nbytes / bytes_per_s))


#: H100 SXM datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3.
H100 = roofline("H100 SXM (datasheet roofline)", 989e12, 3.35e12)


def measured(name: str, gemm_s: dict[int, float], gemm_flops_per_token: float) -> Device:
    """A device running any FLOPs at the FLOP/s its layer GEMMs reached at that token count: ``gemm_s`` is measured
    {tokens: seconds}, interpolated between points (memory traffic is inside the measurement)."""
    pts = sorted(gemm_s.items())

    def gemm_time(t: int) -> float:
        if t <= pts[0][0]:
            return pts[0][1]
        for (t0, s0), (t1, s1) in zip(pts, pts[1:]):
            if t <= t1:
                return s0 + (s1 - s0) * (t - t0) / (t1 - t0)
        return pts[-1][1] * t / pts[-1][0]  # compute-bound beyond the largest measurement

    def time_fn(flops: float, nbytes: float, tokens: int) -> float:
        return flops / (gemm_flops_per_token * tokens / gemm_time(tokens))  # at the measured FLOP/s

    return Device(name, time_fn)


def allreduce_s(nbytes: float, ranks: int, links: Links) -> float:
    """Ring all-reduce: latency plus 2 (p-1)/p of the message over the link (0 for one rank)."""
    if ranks <= 1:
        return 0.0
    return links.allreduce_latency + 2 * (ranks - 1) / ranks * nbytes / links.nvlink_bw


def allgather_s(nbytes: float, ranks: int, links: Links) -> float:
    """Ring all-gather of a ``nbytes`` result: latency plus (p-1)/p of it over the link."""
    if ranks <= 1:
        return 0.0
    return links.allreduce_latency + (ranks - 1) / ranks * nbytes / links.nvlink_bw


@dataclass
class StepEstimate:
    phase: str
    tokens: int  # tokens in the step (decode: the batch; prefill: the prompt)
    compute_s: float
    comm_s: float
    step_s: float  # one forward through every stage (latency)
    comm_share: float
    tokens_per_s: float  # steady state, with ``pp`` micro-batches in flight


def project(m: ModelShape, dev: Device, links: Links, tp: int, pp: int, phase: str, tokens: int,
            ctx: int = 2048) -> StepEstimate:
    """One step of ``tokens`` tokens: decode (``tokens`` sequences of context ``ctx``) or prefill (one prompt of
    ``tokens`` tokens)."""
    if phase not in ("decode", "prefill"):
        raise ValueError(f"phase: decode or prefill, got {phase!r}")
    seqs = tokens if phase == "decode" else 1
    attended = ctx if phase == "decode" else (tokens + 1) / 2  # mean positions each query attends to (causal)
    kv_heads = max(m.kv_heads // tp, 1)
    gemm_flops = 2 * tokens * m.layer_params() / tp
    attn_flops = 4 * tokens * attended * m.q_heads * m.head_dim / tp
    weight_bytes = m.layer_params() / tp * BF16
    kv_bytes = seqs * attended * 2 * kv_heads * m.head_dim * BF16 if phase == "decode" else 0.0
    layer = dev.time(gemm_flops + attn_flops, weight_bytes + kv_bytes, tokens)
    act = tokens * m.hidden * BF16
    head = dev.time(2 * seqs * m.hidden * m.vocab / tp, m.hidden * m.vocab / tp * BF16, seqs)
    compute = m.layers * layer + head
    comm = (m.layers * 2 * allreduce_s(act, tp, links) + allreduce_s(act, tp, links)  # layers, embedding
            + allgather_s(seqs * m.vocab * 4, tp, links)  # fp32 logits
            + (pp - 1) * (links.ib_latency + act / links.ib_bw))  # stage boundaries
    step = compute + comm
    return StepEstimate(phase, tokens, compute, comm, step, comm / step, tokens * pp / step)


def crossing(m: ModelShape, dev: Device, links: Links, tp: int, pp: int, phase: str, ctx: int = 2048,
             max_tokens: int = 1 << 16) -> tuple[list[int], StepEstimate]:
    """The power-of-two token counts up to ``max_tokens`` at which communication takes at least as long as compute,
    and the estimate with the largest communication share."""
    hits, worst, t = [], None, 1
    while t <= max_tokens:
        e = project(m, dev, links, tp, pp, phase, t, ctx)
        if e.comm_s >= e.compute_s:
            hits.append(t)
        if worst is None or e.comm_share > worst.comm_share:
            worst = e
        t *= 2
    return hits, worst


# ---- measurement ---------------------------------------------------------------------------------------------
def measure_layer_gemms(m: ModelShape, tp: int, tokens: Sequence[int], repeats: int = 3) -> dict[int, float]:
    """Median seconds of one rank's four layer GEMMs (fp32, this process's torch threads) per token count."""
    import torch  # heavy: torch

    g = torch.Generator().manual_seed(0)
    ws = [torch.rand(i, o, generator=g) - 0.5 for i, o in m.shard_shapes(tp)]
    out = {}
    for t in tokens:
        xs = [torch.rand(t, w.shape[0], generator=g) - 0.5 for w in ws]
        for x, w in zip(xs, ws):  # warm-up
            x @ w
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for x, w in zip(xs, ws):
                x @ w
            samples.append(time.perf_counter() - t0)
        out[t] = statistics.median(samples)
    return out


def table(rows: list[tuple[str, str, StepEstimate]]) -> str:
    lines = ["| device | parallel | phase | tokens | compute ms | comm ms | step ms | comm share | tokens/s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for dev, par, e in rows:
        lines.append(f"| {dev} | {par} | {e.phase} | {e.tokens} | {e.compute_s * 1e3:.2f} | {e.comm_s * 1e3:.3f} | "
                     f"{e.step_s * 1e3:.2f} | {e.comm_share:.1%} | "
                     + (f"{e.tokens_per_s:,.0f} |" if e.tokens_per_s >= 100 else f"{e.tokens_per_s:.2g} |"))
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("scale-model", help="projected Llama-3-70B step time on TP=8 and TP=8 x PP=2 from measured "
                                           "per-layer compute and datasheet link figures")
    p.add_argument("--measure-tokens", default="1,8,32,128",
                   help="token counts at which one TP=8 rank's layer GEMMs are timed on this CPU")
    p.add_argument("--decode-batches", default="1,8,32,128,256")
    p.add_argument("--prefill-tokens", default="512,2048,8192")
    p.add_argument("--ctx", type=int, default=2048, help="decode context length per sequence")
    p.add_argument("--allreduce-latency-us", type=float, default=20.0, help="all-reduce latency (datasheet: 10-30)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the rows and the measured inputs here")
    p.set_defaults(func=main)


def main(args) -> int:
    import torch  # heavy: torch

    m, links = LLAMA3_70B, Links(allreduce_latency=args.allreduce_latency_us * 1e-6)
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    gemm = measure_layer_gemms(m, 8, ints(args.measure_tokens), args.repeats)
    per_tok = 2 * m.layer_params() / 8
    print(f"measured here: one TP=8 rank's Llama-3-70B layer GEMMs (fp32, {torch.get_num_threads()} thread(s)):")
    for t, s in gemm.items():
        print(f"  {t:5d} tokens: {s * 1e3:8.2f} ms  ({per_tok * t / s / 1e9:.1f} GFLOP/s)")
    cpu = measured("this CPU, 1 rank = measured", gemm, per_tok)
    rows = []
    for dev in (H100, cpu):
        for tp, pp in ((8, 1), (8, 2)):
            par = f"TP={tp}" + (f" PP={pp}" if pp > 1 else "")
            rows += [(dev.name, par, project(m, dev, links, tp, pp, "decode", b, args.ctx))
                     for b in ints(args.decode_batches)]
            rows += [(dev.name, par, project(m, dev, links, tp, pp, "prefill", t)) for t in ints(args.prefill_tokens)]
    print(table(rows))
    for dev in (H100, cpu):
        for tp, pp in ((8, 1), (8, 2)):
            for phase in ("decode", "prefill"):
                hits, worst = crossing(m, dev, links, tp, pp, phase, args.ctx)
                where = (f"at {hits[0]}-{hits[-1]} tokens per step" if hits else "at no token count 1-65536")
                print(f"{dev.name}, TP={tp} PP={pp}, {phase}: communication >= compute {where}; largest share "
                      f"{worst.comm_share:.1%} at {worst.tokens} tokens")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"measured_gemm_s": gemm, "links": asdict(links),
                       "rows": [{"device": d, "parallel": p, **asdict(e)} for d, p, e in rows]}, f, indent=1)
    return 0
