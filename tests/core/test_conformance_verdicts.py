"""Conformance v2 on purpose-built backends: reference ops on a backend's own layout fail, checks that cannot run make
a run PARTIAL, an off-by-one block offset at block size 64 is caught end to end and located, a static policy that
lets unbucketed shapes through fails, and reports carry their verification level into the support matrix."""

from __future__ import annotations

import argparse
import json

import torch

from pagedllm.backend import ref_ops
from pagedllm.backend.registry import Backend
from pagedllm.backend.batch_policy import BatchShape, BucketPolicy, capped_pow2_buckets
from pagedllm.conformance import run_conformance
from pagedllm.conformance import cli as conformance_cli
from pagedllm.conformance.evidence import device_evidence
from pagedllm.conformance.matrix import FEATURES, support_matrix
from pagedllm.conformance.report import PARTIAL, SIMULATION, Report
from pagedllm.conformance.runner import enumerate_cases, run_case
from pagedllm.backend.hookspec import BackendInfo, Capabilities
from plugin_factory import make_plugin
from test_conformance import off_by_one_attention


# ---- a blocks-first layout [num_blocks, 2, block_size, heads, head_size] --------------------------------------
def bf_allocate(spec):
    return [torch.full((spec.num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_size), float("nan"),
                       dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)]


def bf_write(key, value, kv_cache, slot_mapping):
    keep = slot_mapping >= 0
    s = slot_mapping[keep]
    b, o = s // kv_cache.shape[2], s % kv_cache.shape[2]
    kv_cache[b, 0, o] = key[keep]
    kv_cache[b, 1, o] = value[keep]


def bf_gather(kv_cache, block_ids):
    return kv_cache[block_ids].transpose(0, 1).contiguous()


def bf_attention(query, kv_cache, meta, scale, sliding_window, soft_cap):
    return ref_ops.paged_attention(query, kv_cache.transpose(0, 1).contiguous(), meta, scale, sliding_window,
                                   soft_cap)


def bf_swap(src_caches, dst_caches, src, dst):
    for s, d in zip(src_caches, dst_caches):
        d[dst.to(d.device)] = s[src.to(s.device)].to(d.device)


def bf_host(spec, pin_memory):
    return bf_allocate(spec)


BLOCKS_FIRST = dict(allocate_kv_cache=bf_allocate, write_kv=bf_write, gather_kv_blocks=bf_gather,
                    paged_attention=bf_attention)


def test_reference_op_on_a_backends_own_layout_fails_and_swap_without_its_hook_is_refused():
    no_gather = {k: v for k, v in BLOCKS_FIRST.items() if k != "gather_kv_blocks"}
    half = Backend(make_plugin("half-own", **no_gather, swap_kv_blocks=bf_swap), "half-own")
    report = run_conformance(half, allow=["layout_ownership", "write_kv"])
    (own,) = [r for r in report.results if r.kernel == "layout_ownership"]
    assert own.status == "failing" and report.status == "FAIL"
    assert "pagedllm_gather_kv_blocks" in own.error and "pagedllm_allocate_host_kv_cache" not in own.error
    assert "resolve(s) to core's reference op" in own.error and "[2, num_blocks" in own.error

    # own layout, no swap hook: core refuses swap (preemption recomputes) instead of running the reference swap on
    # that layout; the swap cases are not applicable, with the reason, and nothing fails
    no_swap = Backend(make_plugin("no-swap", **BLOCKS_FIRST), "no-swap")
    report = run_conformance(no_swap, allow=["layout_ownership", "swap_kv_blocks", "write_kv"])
    (own,) = [r for r in report.results if r.kernel == "layout_ownership"]
    assert own.status == "passing" and "swap not supported by backend 'no-swap'" in own.detail
    swaps = [r for r in report.results if r.kernel == "swap_kv_blocks"]
    assert swaps and all(r.not_applicable and "preemption uses recompute" in r.error for r in swaps)
    assert report.passed and all(r.status == "passing" for r in report.results if r.kernel == "write_kv")

    whole = Backend(make_plugin("all-own", **BLOCKS_FIRST, swap_kv_blocks=bf_swap,
                                allocate_host_kv_cache=bf_host), "all-own")
    report = run_conformance(whole, allow=["kv_cache"])
    assert report.passed, [(r.id, r.error) for r in report.failing]
    kernels = {r.kernel for r in report.results if r.status == "passing"}
    assert {"layout_ownership", "swap_kv_blocks", "gather_kv_blocks"} <= kernels


class Box:
    """A cache object holding a canonical tensor the checks cannot see through: snapshots and host copies of it
    cannot be made generically, so those checks report untested."""

    def __init__(self, t):
        self.t = t.fill_(float("nan"))  # the suite cannot poison what it cannot see: poison here


BOXED = dict(allocate_kv_cache=lambda spec: [Box(c) for c in ref_ops.allocate_kv_cache(
                 spec.num_layers, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype,
                 spec.device)],
             allocate_host_kv_cache=lambda spec, pin_memory: [Box(c) for c in ref_ops.allocate_kv_cache(
                 spec.num_layers, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype,
                 spec.device)],
             write_kv=lambda key, value, kv_cache, slot_mapping: ref_ops.write_kv(key, value, kv_cache.t,
                                                                                 slot_mapping),
             paged_attention=lambda query, kv_cache, meta, scale, sliding_window, soft_cap: ref_ops.paged_attention(
                 query, kv_cache.t, meta, scale, sliding_window, soft_cap),
             gather_kv_blocks=lambda kv_cache, block_ids: ref_ops.gather_kv_blocks(kv_cache.t, block_ids),
             swap_kv_blocks=lambda src_caches, dst_caches, src, dst: ref_ops.swap_kv_blocks(
                 [c.t for c in src_caches], [c.t for c in dst_caches], src, dst))


def test_untested_checks_make_the_run_partial_never_pass():
    be = Backend(make_plugin("boxed", **BOXED), "boxed")
    cases = [c for c in enumerate_cases(be) if c.kernel in ("layout_ownership", "swap_kv_blocks",
                                                            "graph_runner.replay_vs_eager", "gather_kv_blocks")]
    report = Report(be.name, "cpu", [run_case(be, c) for c in cases])
    by_kernel = {r.kernel: r.status for r in report.results}
    assert by_kernel == {"layout_ownership": "passing", "gather_kv_blocks": "passing", "swap_kv_blocks": "untested",
                         "graph_runner.replay_vs_eager": "untested"}
    assert report.passed and report.status == PARTIAL
    text = report.to_markdown()
    assert "**PARTIAL**" in text and "**PASS**" not in text
    assert report.features()["graph"] == "not-verified"
    # a capability the backend does not declare is not a testing gap: that alone keeps PASS
    nocap = Backend(make_plugin("nocap", caps=Capabilities(sliding_window=False)), "nocap")
    ref = run_conformance(nocap, allow=["rms_norm", "*sliding_window*"])
    assert ref.status == PARTIAL  # the allowlist left declared cases unrun
    sw = [r for r in ref.results if r.kernel == "paged_attention.sliding_window"]
    assert sw and all(r.not_applicable and r.status == "untested" for r in sw)
    ran = [r for r in ref.results if r.status == "passing" or r.not_applicable]
    assert Report("nocap", "cpu", ran).status == "PASS"
    assert Report("nocap", "cpu", ran).features()["attention"] == "not-applicable"  # nothing applicable ran


def test_off_by_one_block_offset_at_block_size_64_is_caught_and_located():
    caps = Capabilities(block_sizes=(16, 64), head_sizes=(64,))
    bad = Backend(make_plugin("obo64", caps=caps, paged_attention=off_by_one_attention), "obo64")
    report = run_conformance(bad, allow=["greedy_parity_vs_hf", "graph_runner.*"])
    rows = {r.id: r for r in report.results if r.status != "untested"}
    assert {r.kernel for r in rows.values()} == {"greedy_parity_vs_hf", "graph_runner.replay_vs_eager"}
    e2e = {r.model: r for r in rows.values() if r.feature == "e2e"}
    assert set(e2e) == {"tiny-llama-hs64-bs64", "tiny-llama-hs64-bs16"}  # every declared block size
    for bs in (16, 64):  # caught by the top-k logprobs against core's reference backend, at the block's last slot
        row = e2e[f"tiny-llama-hs64-bs{bs}"]
        assert row.status == "failing" and "against core's reference backend" in row.error, row.error
        assert f"sequence 1: prompt logprobs of the token at position {bs}, computed at position {bs - 1}, block 0 " \
               f"offset {bs - 1}" in row.error, row.error
    (graph,) = [r for r in rows.values() if r.feature == "graph"]
    assert "bs64" in graph.model  # the largest declared block size
    rows = {r.kernel: r for r in rows.values()}
    # replay vs eager runs the same broken kernel on both sides, so it agrees; the kernel check catches it
    assert rows["graph_runner.replay_vs_eager"].status == "passing"
    kern = run_conformance(bad, allow=["paged_attention.prefill"], gqa_ratios=(1,))
    assert [r.status for r in kern.results if r.kernel == "paged_attention.prefill"] == ["failing", "failing"]


def test_graph_replay_mismatch_names_sequence_position_block_and_head():
    """A runner that shifts positions from the third block of 64 on: the replay check says where it starts."""
    from pagedllm.backend.hookspec import GraphRunner

    def graph_runner(model, max_num_seqs, device, ctx):
        return GraphRunner(run=lambda ids, pos, meta: model(ids, pos + (pos >= 2 * ctx.block_size), meta),
                           level="decode")

    caps = Capabilities(block_sizes=(16, 64), head_sizes=(64,))
    be = Backend(make_plugin("shifty", caps=caps, graph_runner=graph_runner), "shifty")
    (row,) = [r for r in run_conformance(be, allow=["graph_runner.*"]).results if r.status != "untested"]
    assert row.status == "failing"
    assert "prefill: hidden states" in row.error
    assert "sequence 1, position 128, block 2 (physical" in row.error and "head " in row.error, row.error


class LeakyBuckets(BucketPolicy):
    """Claims static buckets but passes every step through unpadded."""

    def pad(self, shape: BatchShape) -> BatchShape:
        return shape


def leaky_policy(ctx):
    return LeakyBuckets(capped_pow2_buckets(ctx.max_num_batched_tokens, 8), capped_pow2_buckets(ctx.max_num_seqs),
                        capped_pow2_buckets(-(-ctx.max_model_len // ctx.block_size)), ctx.block_size)


def test_static_policy_that_leaks_unbucketed_shapes_fails():
    leaky = Backend(make_plugin("leaky", batch_policy=leaky_policy), "leaky")
    report = run_conformance(leaky, allow=["static_shapes"])
    (row,) = [r for r in report.results if r.feature == "static_shapes"]
    assert row.status == "failing" and "outside the" in row.error and "declared bucket shapes" in row.error
    # dynamic backends get no static-shape case at all
    assert not [c for c in enumerate_cases(Backend(make_plugin("dyn"), "dyn")) if c.feature == "static_shapes"]


def test_graph_runner_gets_a_runner_context():
    seen = []

    def graph_runner(model, max_num_seqs, device, ctx):
        from pagedllm.backend.hookspec import GraphRunner

        seen.append(ctx)
        return GraphRunner(run=model)

    be = Backend(make_plugin("ctxgr", graph_runner=graph_runner), "ctxgr")
    report = run_conformance(be, allow=["graph_runner.*"])
    assert report.results and not report.failing
    (ctx,) = seen
    assert ctx.block_size == 16 and ctx.max_model_len == 4 * 16 and ctx.config.block_size == 16
    assert ctx.max_num_seqs == 4 and ctx.pad_slot == -1 and not ctx.policy.static


def test_verification_level_json_and_support_matrix(tmp_path, monkeypatch, capsys):
    be = Backend(make_plugin("simmed", silu_and_mul=ref_ops.silu_and_mul), "simmed")
    report = run_conformance(be, allow=["fused_ops"], simulated="tests/fake layer", report_dir=str(tmp_path))
    assert report.verification == SIMULATION and report.simulated == "tests/fake layer"
    data = json.loads((tmp_path / "conformance-simmed.json").read_text())
    assert data["status"] == "PARTIAL" and data["verification"] == "verified-on-CPU-simulation"
    assert data["features"]["fused_ops"] == "verified-on-CPU-simulation"
    assert data["features"]["attention"] == "not-verified"
    back = Report.from_json((tmp_path / "conformance-simmed.json").read_text())
    assert back.status == report.status and back.features() == report.features()

    monkeypatch.setenv("PAGEDLLM_CONFORMANCE_SIMULATED", "env layer")
    assert run_conformance(be, allow=["rms_norm"]).simulated == "env layer"
    monkeypatch.delenv("PAGEDLLM_CONFORMANCE_SIMULATED")
    hw = run_conformance(Backend(make_plugin("hw", silu_and_mul=ref_ops.silu_and_mul), "hw"), allow=["fused_ops"],
                         report_dir=str(tmp_path))
    assert hw.verification == "verified-on-hardware"

    out = tmp_path / "support-matrix.md"
    parser = argparse.ArgumentParser()
    conformance_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["conformance", "--support-matrix", str(out), "--from-reports",
                              str(tmp_path / "conformance-simmed.json"), str(tmp_path / "conformance-hw.json"),
                              "--backends", "simmed", "hw", "nothere"])
    assert args.func(args) == 0
    text = out.read_text()
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "verified on CPU simulation (" in rows["simmed"] and "PARTIAL (tests/fake layer)" in rows["simmed"]
    assert "verified on hardware (" in rows["hw"] and "verified on CPU simulation" not in rows["hw"]
    assert "not verified (" in rows["simmed"]  # attention: declared, not run
    assert rows["nothere"].count("not verified") == len(FEATURES) and "no report" in rows["nothere"]
    assert "✅" not in text


def write_kv_off_by_one_offset(key, value, kv_cache, slot_mapping, k_scale, v_scale):
    """Canonical layout, but every token lands one slot further on (an off-by-one block offset in the write)."""
    keep = slot_mapping >= 0
    shifted = (slot_mapping[keep] + 1) % (kv_cache.shape[1] * kv_cache.shape[2])
    ref_ops.write_kv(key[keep], value[keep], kv_cache, shifted, k_scale, v_scale)


def test_a_write_bug_fails_the_write_cases_not_every_attention_case():
    """Attention cases fill a canonical cache with core's reference write, so a write bug shows in the write_kv
    cases only, located (input token, slot, block, offset, head), and the attention cases say which write they used."""
    be = Backend(make_plugin("badwrite", write_kv=write_kv_off_by_one_offset), "badwrite")
    report = run_conformance(be, allow=["write_kv", "paged_attention.*"], gqa_ratios=(1,))
    write = [r for r in report.results if r.kernel == "write_kv"]
    assert write and all(r.status == "failing" for r in write)
    assert all("slot " in r.error and " = block " in r.error and "offset " in r.error and "head " in r.error
               for r in write), write[0].error
    attention = [r for r in report.results if r.kernel.startswith("paged_attention") and not r.not_applicable]
    assert attention and all(r.status == "passing" for r in attention), [(r.id, r.error) for r in attention]
    assert all("cache filled by core's reference write_kv (canonical layout)" in r.detail for r in attention)


def test_static_shapes_are_recorded_at_the_runner_boundary_when_the_graph_never_runs_python_hooks():
    """A compiled program never runs the model's forward hooks: shapes are recorded where core hands each step to the
    graph runner, so a static backend without a model runner of its own is checked, never reported untested."""
    from pagedllm.backend.hookspec import GraphRunner

    def bucket_policy(ctx):
        return BucketPolicy(capped_pow2_buckets(ctx.max_num_batched_tokens, 8), capped_pow2_buckets(ctx.max_num_seqs),
                            capped_pow2_buckets(-(-ctx.max_model_len // ctx.block_size)), ctx.block_size)

    def compiled_runner(model, max_num_seqs, device, ctx):  # calls forward directly: no nn.Module hooks run
        return GraphRunner(run=lambda ids, pos, meta: model.forward(ids, pos, meta), level="compile")

    be = Backend(make_plugin("hookless", batch_policy=bucket_policy, graph_runner=compiled_runner), "hookless")
    (row,) = [r for r in run_conformance(be, allow=["static_shapes"]).results if r.feature == "static_shapes"]
    assert row.status == "passing", row.error
    assert "distinct shapes seen of" in row.detail and " 0 forwards" not in row.detail


def test_a_simulation_run_without_simulated_is_not_verified_on_hardware(tmp_path):
    """No evidence of the device, no "verified on hardware": a probe describing a simulation, or a device type torch
    cannot see, makes the report not verified, with the reason, in the report and the support matrix."""
    own_silu = dict(silu_and_mul=ref_ops.silu_and_mul)
    sim = Backend(make_plugin("simnpu", device_name="NPU-910 (simulated on CPU)", **own_silu), "simnpu")
    report = run_conformance(sim, allow=["silu_and_mul"], report_dir=str(tmp_path))
    assert report.verification == "not-verified" and "simulated device" in report.evidence
    assert report.features()["fused_ops"] == "not-verified"
    assert "Verification: not-verified" in report.to_markdown()
    data = json.loads((tmp_path / "conformance-simnpu.json").read_text())
    assert data["verification"] == "not-verified" and "simulated" in data["evidence"]
    assert device_evidence(Backend(make_plugin("hw2", **own_silu), "hw2"))[0]  # the host CPU is its device

    from pagedllm.backend.hookspec import hookimpl
    ghost = make_plugin("ghost")
    ghost.pagedllm_backend_info = hookimpl(lambda: BackendInfo(name="ghost", device_type="xla"))
    ok, why = device_evidence(Backend(ghost, "ghost"))
    assert not ok and "'xla'" in why
    text = support_matrix([report], [])
    row = next(line for line in text.splitlines() if line.startswith("| simnpu"))
    assert "unverified: the backend's probe describes a simulated device" in row and "verified on" not in row
