"""``pagedllm bench graph``: eager vs torch.compile for the CPU backend's graph runner, on a realistic decode step of
core's own model (docs/cpu-backend.md, "Graph strategy").

A tiny Llama (hidden 256, 4 layers, 8 heads / 4 kv heads, head_dim 32, vocab 32000, fp32, random weights) decodes
64 sequences at context 64-96. Reports the first-call (compile) time, steady ms/step, and what a new batch size and a
prefill step cost afterwards. ``reference`` is eager with core's reference kernels instead of the backend's.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from types import SimpleNamespace

import torch

from pagedllm.backend.hookspec import REQUIRED_HOOKS, KVCacheSpec, hookimpl

BLOCK = 16


def add_parser(sub) -> None:
    p = sub.add_parser("graph", help="eager vs torch.compile variants of core's model forward (decode step, tiny "
                                     "Llama)")
    p.add_argument("--variants", default="eager,reference,mlp,layers,full")
    p.add_argument("--steps", type=int, default=10, help="decode steps per timing round")
    p.add_argument("--rounds", type=int, default=5, help="rounds, interleaved across variants; best round counts")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.set_defaults(func=main)


def reference_only(backend):
    """``backend`` reduced to the contract's required hooks (its own identity, probe and memory info), so every
    kernel falls back to core's reference ops."""
    from pagedllm.backend.registry import Backend  # heavy: torch, not at CLI start

    name = f"{backend.name}-reference"
    plugin = SimpleNamespace(**{h: getattr(backend.plugin, h) for h in REQUIRED_HOOKS})
    plugin.pagedllm_backend_info = hookimpl(lambda: replace(backend.info, name=name))
    return Backend(plugin, name)


def build_model(backend, num_blocks: int):
    from transformers import LlamaConfig  # heavy: transformers

    from pagedllm.models.arch import ARCHITECTURES  # heavy: torch, not at CLI start
    from pagedllm.models.causal_lm import CausalLM  # heavy: torch, not at CLI start
    from pagedllm.models.rope import build_cos_sin_cache  # heavy: torch, not at CLI start

    cfg = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=32, vocab_size=32000, max_position_embeddings=2048)
    spec = ARCHITECTURES["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = CausalLM(cfg, spec, backend)
    for p in model.parameters():
        p.normal_(0, 0.05) if p.dim() > 1 else p.fill_(1.0)
    model.cos_sin_cache = build_cos_sin_cache(cfg, 2048, torch.device("cpu"))
    model.kv_caches = backend.allocate_kv_cache(KVCacheSpec(4, num_blocks, BLOCK, 4, 32, torch.float32,
                                                            torch.device("cpu")))
    return model


class Batch:
    """Sequences with fixed random block tables; ``step(qlens)`` builds one step's inputs and advances them."""

    def __init__(self, ctx: list[int], num_blocks: int):
        blocks = list(range(num_blocks))
        random.Random(0).shuffle(blocks)
        per = num_blocks // len(ctx)
        self.tables = [blocks[i * per:(i + 1) * per] for i in range(len(ctx))]
        self.ctx = list(ctx)

    def step(self, qlens: list[int]):
        from pagedllm.backend.attention import AttentionMetadata  # heavy: torch, not at CLI start

        seq_lens = [c + q for c, q in zip(self.ctx, qlens)]
        tables = [t[:(s + BLOCK - 1) // BLOCK] for t, s in zip(self.tables, seq_lens)]
        meta = AttentionMetadata.build(qlens, seq_lens, tables, BLOCK)
        positions = torch.tensor([p for c, q in zip(self.ctx, qlens) for p in range(c, c + q)])
        ids = torch.randint(0, 32000, (len(positions),))
        self.ctx = seq_lens
        return ids, positions, meta


def timed(run, batch: Batch, qlens: list[int], n: int, clock=time.perf_counter) -> float:
    """ms per step of ``run``; inputs are built outside the timed region."""
    total = 0.0
    for _ in range(n):
        args = batch.step(qlens)
        t = clock()
        run(*args)
        total += clock() - t
    return total / n * 1e3


def make_variant(name: str, model):
    from pagedllm.backend import ref_ops  # heavy: torch, not at CLI start

    if name in ("eager", "reference"):
        return model
    # The backend's attention must be opaque to dynamo (it plans on the host with Python ints): exclude it.
    # Rotary goes back to the reference formula, which inductor fuses (our eager one writes into out= views).
    for layer in model.layers:
        attn = layer.self_attn
        attn.rotary = ref_ops.rotary
        attn.write_kv = torch.compiler.disable(attn.write_kv)
        attn.paged_attention = torch.compiler.disable(attn.paged_attention)
    if name == "full":  # whole forward, graph breaks around attention
        return torch.compile(model, dynamic=True)
    if name == "layers":  # regional: each decoder layer (breaks around its attention)
        for layer in model.layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)
        return model
    if name == "mlp":  # dense parts only: norms and MLPs, no attention anywhere near
        for layer in model.layers:
            layer.mlp.forward = torch.compile(layer.mlp.forward, dynamic=True)
            layer.post_attention_layernorm.forward = torch.compile(layer.post_attention_layernorm.forward,
                                                                   dynamic=True)
        return model
    raise ValueError(name)


def main(args) -> int:
    from pagedllm.backend.registry import get_backend  # heavy: torch, not at CLI start

    if args.threads:
        torch.set_num_threads(args.threads)
    backend = get_backend("cpu")  # by name: core imports no plugin
    reference = reference_only(backend)
    num_blocks = 64 * 32
    ctx = [random.Random(i).randint(64, 96) for i in range(64)]
    runs, report = {}, {}
    with torch.inference_mode():
        for name in args.variants.split(","):
            model = build_model(reference if name == "reference" else backend, num_blocks)
            run = make_variant(name, model)
            batch = Batch(ctx, num_blocks)
            t0 = time.perf_counter()
            run(*batch.step([1] * 64))
            first = time.perf_counter() - t0
            timed(run, batch, [1] * 64, 3)
            t0 = time.perf_counter()
            run(*Batch(ctx[:48], num_blocks).step([1] * 48))
            new_batch = time.perf_counter() - t0
            t0 = time.perf_counter()
            run(*Batch([0] * 4, num_blocks).step([64] * 4))
            prefill_first = time.perf_counter() - t0
            prefill = timed(run, Batch([0] * 4, num_blocks), [64] * 4, 3)
            runs[name] = (run, batch, Batch(ctx, num_blocks))
            report[name] = (first, new_batch, prefill_first, prefill)
        best = {name: float("inf") for name in runs}
        cpu = dict(best)
        for _ in range(args.rounds):
            for name, (run, _, _) in runs.items():  # same contexts every round
                best[name] = min(best[name], timed(run, Batch(ctx, num_blocks), [1] * 64, args.steps))
                cpu[name] = min(cpu[name], timed(run, Batch(ctx, num_blocks), [1] * 64, args.steps, time.process_time))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; best of {args.rounds} rounds x {args.steps} "
          "steps; cpu = process time (less sensitive to other load on a shared machine)")
    for name, (first, new_batch, prefill_first, prefill) in report.items():
        print(f"{name:7s} first call {first:6.2f} s | decode 64 seqs: wall {best[name]:6.2f} ms/step "
              f"({64 / best[name] * 1e3:5.0f} tok/s), cpu {cpu[name]:6.2f} ms | first batch-48 call "
              f"{new_batch * 1e3:6.1f} ms | first prefill 4x64 {prefill_first * 1e3:6.1f} ms, then {prefill:6.2f} ms")
    return 0
