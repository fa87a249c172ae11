"""Enumerate a backend's conformance cases from its declared Capabilities, select, run, report."""

from __future__ import annotations

import os
import re
import time
import traceback
from dataclasses import dataclass, field
from itertools import product
from typing import Callable, Iterable, Optional, Union

import torch

import pagedllm
from pagedllm.backend.registry import Backend, BackendError, get_backend
from pagedllm.conformance import (checks_e2e, checks_kernels as K, checks_kv_groups as G, checks_layout,
                                  checks_runtime as R, checks_ssm, checks_state, checks_static)
from pagedllm.conformance.evidence import device_evidence
from pagedllm.conformance.harness import CaseContext, CheckFailed, NotApplicable, Untested, case_seed
from pagedllm.conformance.report import NOT_VERIFIED, SIMULATION, CaseResult, Report, case_id

#: Set by tests that run a backend on a simulated device layer: a description of that layer
#: (e.g. "tests/support/sim/<vendor>, torch PrivateUse1 python backend").
SIMULATED_ENV = "PAGEDLLM_CONFORMANCE_SIMULATED"

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: Default (atol, rtol) per dtype; data-movement hooks (write_kv, gather/copy/swap) are compared exactly.
DEFAULT_TOLERANCES = {"float32": (1e-4, 1e-4), "float16": (4e-3, 4e-3), "bfloat16": (3e-2, 3e-2)}
#: Query heads per KV head tried for attention: MHA, an odd group (e.g. SmolLM2's 3), a power of two.
GQA_RATIOS = (1, 3, 4)
#: Head sizes checked for a backend that takes any (``Capabilities.head_sizes = None``): tiny test models' 16,
#: the common ones, and two that are not powers of two.
ANY_HEAD_SIZES = (64, 16, 32, 80, 96, 128, 256)
#: Weight types checked per declared quantization method (each against core's reference).
CONFORMANCE_WEIGHT_TYPES = {"gguf": ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"), "gptq": ("int4", "int8"),
                            "awq": ("int4",), "compressed-tensors": ("W4A16", "W8A16", "W8A8"),
                            "fp8": ("e4m3_tensor", "e4m3_channel", "e4m3_block")}


@dataclass
class Case:
    feature: str
    kernel: str
    model: str
    dtype: str
    check: Callable[[CaseContext], None]
    params: dict = field(default_factory=dict)
    untested: str = ""  # set when the backend's capabilities rule the case out
    #: the hooks the case checks: when the backend implements none of them, it ran core's reference code
    hooks: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return case_id(self.kernel, self.model, self.dtype)

    def fallback(self, backend: Backend) -> bool:
        return bool(self.hooks) and not any(backend.implements(h) for h in self.hooks)


#: The hooks each check exercises (the graph, e2e and static cases run the backend's whole set of op hooks).
OP_HOOKS = ("pagedllm_write_kv", "pagedllm_paged_attention", "pagedllm_rms_norm", "pagedllm_fused_add_rms_norm",
            "pagedllm_rotary", "pagedllm_silu_and_mul", "pagedllm_graph_runner", "pagedllm_model_runner",
            "pagedllm_batch_policy")
CHECK_HOOKS = {
    R.check_memory_info: ("pagedllm_memory_info",),
    R.check_allocator: ("pagedllm_allocate_kv_cache",),
    K.check_write_kv: ("pagedllm_write_kv",),
    K.check_gather: ("pagedllm_gather_kv_blocks",),
    K.check_swap: ("pagedllm_swap_kv_blocks", "pagedllm_allocate_host_kv_cache"),
    K.check_attention: ("pagedllm_paged_attention",),
    K.check_encoder_attention: ("pagedllm_encoder_attention",),
    K.check_mla_attention: ("pagedllm_write_mla_kv", "pagedllm_mla_attention"),
    K.check_rms_norm: ("pagedllm_rms_norm",),
    K.check_fused_add_rms_norm: ("pagedllm_fused_add_rms_norm",),
    K.check_silu_and_mul: ("pagedllm_silu_and_mul",),
    K.check_rotary: ("pagedllm_rotary",),
    K.check_add_lora: ("pagedllm_add_lora",),
    K.check_fused_moe: ("pagedllm_fused_moe",),
    K.check_apply_token_bitmask: ("pagedllm_apply_token_bitmask",),
    K.check_dense_linear: ("pagedllm_quantized_linear",),
    K.check_quantized_linear: ("pagedllm_quantized_linear",),
    checks_layout.check_layout_ownership: ("pagedllm_allocate_kv_cache",),
    R.check_graph_replay: ("pagedllm_graph_runner",),
    checks_e2e.check_e2e: OP_HOOKS,
    checks_state.check_causal_conv1d: ("pagedllm_causal_conv1d_fn", "pagedllm_allocate_state_cache"),
    checks_state.check_causal_conv1d_update: ("pagedllm_causal_conv1d_update", "pagedllm_allocate_state_cache"),
    checks_state.check_state_carry_e2e: OP_HOOKS + ("pagedllm_causal_conv1d_fn", "pagedllm_causal_conv1d_update",
                                                    "pagedllm_allocate_state_cache"),
    checks_static.check_static_shapes: ("pagedllm_batch_policy",),
    G.check_full_and_sliding: G.GROUP_HOOKS + ("pagedllm_write_kv", "pagedllm_paged_attention"),
    G.check_mla_group: G.GROUP_HOOKS + ("pagedllm_write_mla_kv", "pagedllm_mla_attention"),
    G.check_state_group: G.GROUP_HOOKS + ("pagedllm_allocate_state_cache", "pagedllm_causal_conv1d_update"),
    **checks_ssm.CHECK_HOOKS,
}


def enumerate_cases(backend: Backend, gqa_ratios: Iterable[int] = GQA_RATIOS) -> list[Case]:
    """Every case implied by ``backend.capabilities``: dtypes x head sizes x block sizes x GQA ratios."""
    caps = backend.capabilities
    head_sizes = caps.head_sizes or ANY_HEAD_SIZES
    hs0, bs0 = head_sizes[0], caps.block_sizes[0]
    cases = [Case("memory", "memory_info", "-", "-", R.check_memory_info)]
    for dt in caps.dtypes:
        for bs in caps.block_sizes:
            cases.append(Case("kv_cache", "allocate_kv_cache", f"hs{hs0}-bs{bs}", dt, R.check_allocator,
                              dict(head_size=hs0, block_size=bs)))
        for hs, bs in product(head_sizes, caps.block_sizes):
            cases.append(Case("kv_cache", "write_kv", f"hs{hs}-bs{bs}", dt, K.check_write_kv,
                              dict(head_size=hs, block_size=bs)))
        for bs in caps.block_sizes:
            for name, fn in (("gather_kv_blocks", K.check_gather), ("swap_kv_blocks", K.check_swap)):
                cases.append(Case("kv_cache", name, f"hs{hs0}-bs{bs}", dt, fn, dict(head_size=hs0, block_size=bs)))
        for scenario, hs, bs, g in product(("decode", "prefill", "mixed"), head_sizes, caps.block_sizes,
                                           gqa_ratios):
            cases.append(Case("attention", f"paged_attention.{scenario}", f"hs{hs}-bs{bs}-gqa{g}", dt,
                              K.check_attention, dict(scenario=scenario, head_size=hs, block_size=bs, gqa=g)))
        for batch, causal, g in product(K.ENCODER_BATCHES, (False, True), gqa_ratios):
            cases.append(Case("attention", f"encoder_attention.{'causal' if causal else 'bidirectional'}",
                              f"{batch}-hs{hs0}-gqa{g}", dt, K.check_encoder_attention,
                              dict(batch=batch, causal=causal, head_size=hs0, gqa=g)))
        for hs in head_sizes[1:]:  # every other declared head size (vision towers: 72, 80...) on the varlen batch
            cases.append(Case("attention", "encoder_attention.bidirectional", f"varlen-hs{hs}-gqa{max(gqa_ratios)}",
                              dt, K.check_encoder_attention,
                              dict(batch="varlen", causal=False, head_size=hs, gqa=max(gqa_ratios))))
        g = max(gqa_ratios)
        for bs in caps.block_sizes:
            cases.append(Case("attention", "paged_attention.sliding_window", f"hs{hs0}-bs{bs}-gqa{g}", dt,
                              K.check_attention, dict(scenario="mixed", head_size=hs0, block_size=bs, gqa=g,
                                                      sliding_window=bs // 2 + 3),
                              untested="" if caps.sliding_window else "capabilities do not declare sliding_window"))
            cases.append(Case("attention", "paged_attention.soft_cap", f"hs{hs0}-bs{bs}-gqa{g}", dt,
                              K.check_attention, dict(scenario="mixed", head_size=hs0, block_size=bs, gqa=g,
                                                      soft_cap=1.5, query_scale=3.0),
                              untested="" if caps.soft_cap else "capabilities do not declare soft_cap"))
            cases.append(Case("attention", "paged_attention.alibi", f"hs{hs0}-bs{bs}-gqa{g}", dt,
                              K.check_attention, dict(scenario="mixed", head_size=hs0, block_size=bs, gqa=g,
                                                      alibi=True),
                              untested="" if caps.alibi else "capabilities do not declare alibi"))
            for scenario, window in (("decode", None), ("prefill", None), ("mixed", None), ("mixed", bs // 2 + 3)):
                missing = [f for f, need in (("attention_sinks", True), ("sliding_window", bool(window)))
                           if need and not getattr(caps, f)]
                cases.append(Case("attention", f"paged_attention.sinks.{scenario}" + ".sliding_window" * bool(window),
                                  f"hs{hs0}-bs{bs}-gqa{g}", dt, K.check_attention,
                                  dict(scenario=scenario, head_size=hs0, block_size=bs, gqa=g, sinks=True,
                                       sliding_window=window),
                                  untested=f"capabilities do not declare {missing[0]}" if missing else ""))
            for scenario, window in (("prefill", None), ("mixed", None), ("mixed", bs // 2 + 3)):
                # Gemma 3 with vision: bidirectional image spans inside prefill chunks (meta.mm_prefix_ranges)
                missing = [f for f, need in (("mm_prefix_lm", True), ("sliding_window", bool(window)))
                           if need and not getattr(caps, f)]
                cases.append(Case("attention", f"paged_attention.mm_prefix.{scenario}"
                                  + ".sliding_window" * bool(window), f"hs{hs0}-bs{bs}-gqa{g}", dt, K.check_attention,
                                  dict(scenario=scenario, head_size=hs0, block_size=bs, gqa=g, mm_prefix=True,
                                       sliding_window=window),
                                  untested=f"capabilities do not declare {missing[0]}" if missing else ""))
        for kvd in (k for k in caps.kv_cache_dtypes if k != "auto"):  # fp8 KV: scaled writes, reads, swaps
            bs = caps.block_sizes[0]
            fp8 = dict(head_size=hs0, block_size=bs, kv_cache_dtype=kvd, k_scale=0.05, v_scale=2.0)
            cases.append(Case("kv_cache", f"write_kv.{kvd}", f"hs{hs0}-bs{bs}", dt, K.check_write_kv, fp8))
            cases.append(Case("kv_cache", f"swap_kv_blocks.{kvd}", f"hs{hs0}-bs{bs}", dt, K.check_swap, fp8))
            for scenario in ("decode", "mixed"):
                cases.append(Case("attention", f"paged_attention.{kvd}.{scenario}", f"hs{hs0}-bs{bs}-gqa3", dt,
                                  K.check_attention, dict(fp8, scenario=scenario, gqa=3)))
        g = max(gqa_ratios)
        for bs in caps.block_sizes:  # KV cache groups (v4): full + sliding window sharing tensors, MLA, state
            cases.append(Case("kv_cache", "kv_cache.groups.full_sliding", f"hs{hs0}-bs{bs}-gqa{g}", dt,
                              G.check_full_and_sliding, dict(head_size=hs0, block_size=bs, gqa=g,
                                                             sliding_window=bs // 2 + 3),
                              untested="" if caps.sliding_window else "capabilities do not declare sliding_window"))
        # the MLA and state groups count under the features of their kernels (the mla_attention and conv cases)
        cases.append(Case("fused_ops", "kv_cache.groups.mla", f"latent40-rope16-h5-bs{bs0}", dt, G.check_mla_group,
                          dict(kv_lora_rank=40, rope=16, heads=5, block_size=bs0),
                          untested="" if caps.mla else "capabilities do not declare mla"))
        no_conv = ("capabilities' state_ops leave out conv" if "conv" not in (caps.state_ops or ("conv",))
                   else f"capabilities' state_dtypes leave out {dt}" if dt not in (caps.state_dtypes or (dt,)) else "")
        cases.append(Case("state", "kv_cache.groups.state", f"dim64-w4-hs{hs0}-bs{bs0}", dt, G.check_state_group,
                          dict(dim=64, width=4, head_size=hs0, block_size=bs0), untested=no_conv))
        cases.append(Case("fused_ops", "rms_norm", "hidden576", dt, K.check_rms_norm, dict(hidden=576)))
        cases.append(Case("fused_ops", "fused_add_rms_norm", "hidden576", dt, K.check_fused_add_rms_norm,
                          dict(hidden=576)))
        cases.append(Case("fused_ops", "silu_and_mul", "d320", dt, K.check_silu_and_mul, dict(hidden=320)))
        for layout in ("uniform", "uniform_consecutive", "uneven"):
            cases.append(Case("fused_ops", "add_lora", layout, dt, K.check_add_lora, dict(layout=layout)))
        cases.append(Case("fused_ops", "fused_moe", "h96-i80-e6-k2", dt, K.check_fused_moe,
                          dict(hidden=96, intermediate=80, experts=6, top_k=2)))
        cases.append(Case("fused_ops", "mla_attention", f"latent40-rope16-h5-bs{caps.block_sizes[0]}", dt,
                          K.check_mla_attention, dict(kv_lora_rank=40, rope=16, heads=5,
                                                      block_size=caps.block_sizes[0]),
                          untested="" if caps.mla else "capabilities do not declare mla"))
        for kernel, model, check, params in checks_ssm.cases():  # Mamba2 and Gated DeltaNet state ops
            cases.append(Case("state", kernel, model, dt, check, params))
        for activation in (None, "silu"):  # recurrent state (v3): LFM2's kernel 3, Mamba2's 4
            act = activation or "identity"
            for scenario, width in product(checks_state.CONV_BATCHES, (3, 4)):
                cases.append(Case("state", f"causal_conv1d_fn.{scenario}", f"dim64-w{width}-{act}", dt,
                                  checks_state.check_causal_conv1d,
                                  dict(scenario=scenario, dim=64, width=width, activation=activation)))
            cases.append(Case("state", "causal_conv1d_update", f"dim64-w4-{act}", dt,
                              checks_state.check_causal_conv1d_update, dict(dim=64, width=4, activation=activation)))
        for hs in head_sizes:
            for rot in (hs, hs // 2):
                cases.append(Case("fused_ops", "rotary", f"hs{hs}-rot{rot}", dt, K.check_rotary,
                                  dict(head_size=hs, rot_dim=rot)))
        if backend.quantized_linear("unquantized", str(dt).removeprefix("torch.")) is not None:  # optional kernel
            cases.append(Case("fused_ops", "dense_linear", "n96-k512", dt, K.check_dense_linear,
                              dict(out_features=96, in_features=512)))
        for method in caps.quantization:
            for wtype in CONFORMANCE_WEIGHT_TYPES.get(method, ()):
                own = backend.quantized_linear(method, wtype) is not None
                cases.append(Case("quantization", f"quantized_linear.{method}", f"{wtype}-n96-k512", dt,
                                  K.check_quantized_linear, dict(method=method, weight_type=wtype,
                                                                 out_features=96, in_features=512),
                                  untested="" if own else f"no {method} {wtype} kernel: core's reference serves it"))
    dt0 = "float32" if "float32" in caps.dtypes else caps.dtypes[0]
    bs_max = max(caps.block_sizes)  # e2e and replay sequences span several blocks of the largest size
    for width in (96, 128):  # the mask narrower / wider than the logits
        cases.append(Case("fused_ops", "apply_token_bitmask", f"w{width}", "float32", K.check_apply_token_bitmask,
                          dict(mask_width=width)))
    cases.append(Case("kv_cache", "layout_ownership", f"hs{hs0}-bs{bs0}", dt0, checks_layout.check_layout_ownership,
                      dict(head_size=hs0, block_size=bs0)))
    cases.append(Case("graph", "graph_runner.replay_vs_eager", f"tiny-decoder-hs{hs0}-bs{bs_max}", dt0,
                      R.check_graph_replay, dict(head_size=hs0, block_size=bs_max)))
    hs_e2e = 64 if 64 in head_sizes else hs0
    no_f32 = "" if "float32" in caps.dtypes else "needs float32, not declared"
    for bs in sorted(caps.block_sizes, reverse=True):  # every block size it accepts, prompts crossing several blocks
        cases.append(Case("e2e", "greedy_parity_vs_hf", f"tiny-llama-hs{hs_e2e}-bs{bs}", "float32",
                          checks_e2e.check_e2e, dict(head_size=hs_e2e, block_size=bs),
                          untested=no_f32 and f"capabilities do not declare float32: end-to-end parity {no_f32}"))
    bs_min = min(caps.block_sizes)  # prompts over several blocks, cut by the budget off block boundaries
    cases.append(Case("state", "state_carry_vs_hf", f"tiny-lfm2-hs{hs_e2e}-bs{bs_min}-budget7", "float32",
                      checks_state.check_state_carry_e2e, dict(head_size=hs_e2e, block_size=bs_min, budget=7),
                      untested=no_f32 and f"capabilities do not declare float32: end-to-end parity {no_f32}"))
    if _static(backend, bs_max):
        cases.append(Case("static_shapes", "buckets_only_and_equal_to_dynamic", f"tiny-llama-hs{hs_e2e}-bs{bs_max}",
                          "float32", checks_static.check_static_shapes, dict(head_size=hs_e2e, block_size=bs_max),
                          untested=no_f32 and f"static-shape parity {no_f32}"))
    cases += undeclared_cases(caps, hs0, bs0)
    for c in cases:
        if c.dtype not in DTYPES and c.dtype != "-" and not c.untested:
            c.untested = f"dtype {c.dtype!r} is not known to the conformance suite"
        c.hooks = c.hooks or CHECK_HOOKS.get(c.check, ())
    return cases


def undeclared_cases(caps, hs0: int, bs0: int) -> list[Case]:
    """One not-applicable row per model dtype, fp8 KV dtype and quantization method the backend does not declare,
    so the report says what it does not run, and why."""
    from pagedllm.quantization import IMPLEMENTED  # heavy: pagedllm.quantization, not at CLI start

    out = []
    for dt in (d for d in DTYPES if d not in caps.dtypes):  # dtype "-": no column of its own in the matrix
        out.append(Case("dtype", f"dtype.{dt}", "-", "-", K.check_attention,
                        untested=f"capabilities do not declare dtype {dt}"))
    for kvd in ("fp8_e4m3", "fp8_e5m2"):
        if kvd not in caps.kv_cache_dtypes and not (kvd == "fp8_e4m3" and "fp8" in caps.kv_cache_dtypes):
            out.append(Case("kv_cache", f"write_kv.{kvd}", f"hs{hs0}-bs{bs0}", caps.dtypes[0], K.check_write_kv,
                            dict(head_size=hs0, block_size=bs0, kv_cache_dtype=kvd),
                            untested=f"capabilities do not declare kv_cache_dtype {kvd}"))
    for method in (m for m in CONFORMANCE_WEIGHT_TYPES if m not in caps.quantization and m in IMPLEMENTED):
        out.append(Case("quantization", f"quantized_linear.{method}", "-", caps.dtypes[0], K.check_quantized_linear,
                        untested=f"capabilities do not declare quantization {method}"))
    return out


def _static(backend: Backend, block_size: int) -> bool:
    try:
        return checks_static.is_static(backend, block_size)
    except Exception:  # a policy hook that raises here fails in the static case itself, never silently
        return True


def _match(pattern: str, case: Case) -> bool:
    """Shell-style ``*``/``?`` (brackets literal) against the case id, its kernel or its feature."""
    rx = re.compile(re.escape(pattern).replace(r"\*", ".*").replace(r"\?", ".") + r"\Z")
    return any(rx.match(s) for s in (case.id, case.kernel, case.feature))


def selection_reason(case: Case, allow: Optional[Iterable[str]], exclude: Optional[Iterable[str]]) -> str:
    """Why ``case`` is not run ('' when it is): capabilities, the allowlist, or an exclusion."""
    if case.untested:
        return case.untested
    allow, exclude = list(allow or []), list(exclude or [])
    if allow and not any(_match(p, case) for p in allow):
        return "not in the allowlist"
    for p in exclude:
        if _match(p, case):
            return f"excluded by {p!r}"
    return ""


def tolerance(case: Case, overrides: Optional[dict]) -> tuple[float, float]:
    """A matching pattern key of ``overrides`` wins, then a dtype key, then :data:`DEFAULT_TOLERANCES`."""
    overrides = overrides or {}
    for key, tol in overrides.items():
        if key not in DTYPES and _match(key, case):
            return tuple(tol)  # type: ignore[return-value]
    return tuple(overrides.get(case.dtype, DEFAULT_TOLERANCES.get(case.dtype, (0.0, 0.0))))  # type: ignore


def run_case(backend: Backend, case: Case, tolerances: Optional[dict] = None, seed: int = 0) -> CaseResult:
    atol, rtol = tolerance(case, tolerances)
    ctx = CaseContext(backend, backend.device(), DTYPES.get(case.dtype, torch.float32), case.params, atol, rtol,
                      case_seed(seed, case.id))
    t0 = time.perf_counter()
    status, error, na = "passing", "", False
    try:
        with torch.no_grad():
            case.check(ctx)
    except NotApplicable as e:
        status, error, na = "untested", str(e), True
    except Untested as e:
        status, error = "untested", str(e)
    except CheckFailed as e:
        status, error = "failing", str(e)
    except Exception as e:  # the backend raised: a failure, with where it came from
        where = traceback.extract_tb(e.__traceback__)[-1]
        status, error = "failing", f"{type(e).__name__}: {e} (at {where.filename}:{where.lineno})"
    return CaseResult(case.feature, case.kernel, case.model, case.dtype, status, error,
                      "; ".join(dict.fromkeys(ctx.notes)), ctx.max_abs_err if status != "untested" else None,
                      round(time.perf_counter() - t0, 3), not_applicable=na,
                      fallback=status != "untested" and case.fallback(backend))


def run_conformance(backend: Union[str, Backend], report_dir: Optional[str] = None,
                    allow: Optional[Iterable[str]] = None, exclude: Optional[Iterable[str]] = None,
                    tolerances: Optional[dict] = None, *, seed: int = 0, gqa_ratios: Iterable[int] = GQA_RATIOS,
                    progress: Optional[Callable[[CaseResult], None]] = None,
                    simulated: Optional[str] = None) -> Report:
    """Check every contract hook of ``backend`` (a name or a :class:`Backend`) against core's reference ops.

    ``allow``/``exclude``: patterns (``*``, ``?``) on case ids ``kernel[model|dtype]``, kernels or features; cases
    not selected are reported untested (the run is then PARTIAL). ``tolerances``: ``{dtype or pattern: (atol,
    rtol)}`` overrides. ``simulated``: a description of the simulated device layer the backend runs on (default:
    the ``PAGEDLLM_CONFORMANCE_SIMULATED`` environment variable); the report is then
    ``verified-on-CPU-simulation``, else ``verified-on-hardware``. Writes ``conformance-<name>.{md,json,csv}`` to
    ``report_dir`` when given. ``report.status`` is PASS, PARTIAL or FAIL.
    """
    be = get_backend(backend) if isinstance(backend, str) else backend
    if not be.probe.usable:
        raise BackendError(f"backend {be.name!r} is not usable here: {be.probe.reason}")
    caps = be.capabilities
    report = Report(be.name, str(be.device()), environment={
        "pagedllm": getattr(pagedllm, "__version__", "?"), "torch": torch.__version__,
        "device_name": be.probe.device_name, "graph_capture": caps.graph_capture, "seed": seed,
        "kv_cache_groups": "own" if be.implements("pagedllm_allocate_kv_cache_groups") else "reference"})
    simulated = simulated if simulated is not None else os.environ.get(SIMULATED_ENV, "")
    if simulated:
        report.verification, report.simulated = SIMULATION, simulated
    else:  # "on hardware" only with evidence of the device
        real, report.evidence = device_evidence(be)
        report.verification = report.verification if real else NOT_VERIFIED
    for case in enumerate_cases(be, tuple(gqa_ratios)):
        reason = selection_reason(case, allow, exclude)
        if reason:
            result = CaseResult(case.feature, case.kernel, case.model, case.dtype, "untested", reason,
                                not_applicable=bool(case.untested))
        else:
            result = run_case(be, case, tolerances, seed)
        report.results.append(result)
        if progress is not None:
            progress(result)
    if report_dir:
        report.write(report_dir)
    return report
