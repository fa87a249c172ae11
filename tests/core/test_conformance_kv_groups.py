"""Conformance of KV cache groups (contract v4, issue 28): the ``kv_cache.groups.*`` cases pass on the cpu backend
(core's reference allocator path, from its own ``allocate_kv_cache``) and on a backend with its own
``pagedllm_allocate_kv_cache_groups`` that ignores core's sharing; they FAIL a backend whose hook aliases two
sliding-window layers onto one tensor (their writes land in each other's blocks) and one whose return the registry
refuses; ``pagedllm backends`` and the support matrix say who allocates the groups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pagedllm.backend import Capabilities, KVCacheConfig
from pagedllm.backend.registry import get_backend, register_backend
from pagedllm.commands.backends import kv_cache_groups, rows, table
from pagedllm.conformance.matrix import support_matrix
from pagedllm.conformance.runner import run_conformance
from plugin_factory import REFERENCE_FEATURES, make_plugin, per_layer_allocator

GROUPS = ["kv_cache.groups.*[*|float32]"]
SIM = str(Path(__file__).resolve().parents[1] / "support" / "sim")
CAPS = Capabilities(**REFERENCE_FEATURES, dtypes=("float32",), head_sizes=(16,), block_sizes=(8,))


def groups_run(backend) -> dict:
    report = run_conformance(backend, allow=GROUPS)
    return {r.kernel: r for r in report.results if r.kernel.startswith("kv_cache.groups.") and r.dtype == "float32"}


@pytest.mark.parametrize("name", ["cpu", "cpu-static"])
def test_cpu_passes_the_group_cases_on_the_reference_allocator_path(name):
    got = groups_run(name)
    assert set(got) == {"kv_cache.groups.full_sliding", "kv_cache.groups.mla", "kv_cache.groups.state"}
    for r in got.values():
        assert r.status == "passing", (r.id, r.error)
        assert "core's reference allocator path" in r.detail
        assert not r.fallback  # cpu's own allocate_kv_cache / write_kv / paged_attention ran
    assert "tensors shared by [[1, 0], [3, 2]]" in got["kv_cache.groups.full_sliding"].detail


def test_own_unshared_layout_passes():
    name = register_backend(make_plugin("kvg-own", CAPS, allocate_kv_cache_groups=per_layer_allocator()),
                            "kvg-own").name
    assert get_backend(name).implements("pagedllm_allocate_kv_cache_groups")
    got = groups_run(name)
    for r in got.values():
        assert r.status == "passing", (r.id, r.error)
        assert "the backend's own pagedllm_allocate_kv_cache_groups" in r.detail
        assert not r.fallback


def test_sliding_layers_aliasing_each_others_blocks_fail():
    """Layers 0 and 2 form the sliding-window group: the same block ids hold different layers' keys, so one
    tensor for both loses layer 0's keys to layer 2's writes. The registry's checks (every layer, shape, dtype)
    cannot see it; attention read back can."""
    name = register_backend(make_plugin("kvg-alias", CAPS, allocate_kv_cache_groups=per_layer_allocator(alias=(0, 2))),
                            "kvg-alias").name
    r = groups_run(name)["kv_cache.groups.full_sliding"]
    assert r.status == "failing"
    assert "attention output of layer 0 (sliding_window group)" in r.error, r.error
    assert "shares a tensor only between layers [1, 0]" in r.error


def test_full_and_sliding_layer_aliasing_against_disjoint_blocks_passes():
    """Core's own layout: a full and a sliding layer on one tensor, at disjoint blocks of one pool (the null block
    0 of the sliding table never read)."""
    name = register_backend(make_plugin("kvg-share", CAPS, allocate_kv_cache_groups=per_layer_allocator(alias=(1, 0))),
                            "kvg-share").name
    r = groups_run(name)["kv_cache.groups.full_sliding"]
    assert r.status == "passing", r.error


def test_a_return_the_registry_refuses_fails_naming_the_group():
    def short(config: KVCacheConfig) -> dict:
        caches = per_layer_allocator()(config)
        caches[2] = caches[2][:, :-1]  # one block short
        return caches

    name = register_backend(make_plugin("kvg-short", CAPS, allocate_kv_cache_groups=short), "kvg-short").name
    r = groups_run(name)["kv_cache.groups.full_sliding"]
    assert r.status == "failing"
    assert "BackendError" in r.error and "layer 2 of KV cache group 1 (sliding_window" in r.error, r.error


def test_undeclared_features_are_not_applicable():
    caps = Capabilities(**{**REFERENCE_FEATURES, "sliding_window": False, "mla": False}, dtypes=("float32",),
                        head_sizes=(16,), block_sizes=(8,), state_ops=("ssm",))
    name = register_backend(make_plugin("kvg-bare", caps), "kvg-bare").name
    report = run_conformance(name, allow=GROUPS)
    got = {r.kernel: r for r in report.results if r.kernel.startswith("kv_cache.groups.")}
    assert all(r.not_applicable for r in got.values()), got
    assert "sliding_window" in got["kv_cache.groups.full_sliding"].error
    assert "state_ops leave out conv" in got["kv_cache.groups.state"].error


def test_backends_and_matrix_say_who_allocates_the_groups():
    name = register_backend(make_plugin("kvg-list", CAPS, allocate_kv_cache_groups=per_layer_allocator()),
                            "kvg-list").name
    report = run_conformance(name, allow=GROUPS)
    assert report.environment["kv_cache_groups"] == "own"
    cpu = run_conformance("cpu", allow=["kv_cache.groups.full_sliding[hs64-bs8-gqa4|float32]"])
    assert cpu.environment["kv_cache_groups"] == "reference"
    md = support_matrix([report, cpu])
    section = md.split("## KV cache groups", 1)[1]
    assert f"- `{name}`: its own allocator (`pagedllm_allocate_kv_cache_groups`); kv_cache.groups cases: 3/3 " \
           "passing\n" in section
    assert "- `cpu`: core's reference allocator" in section and "cases: 1/21 passing, 20 not run" in section

    out = subprocess.run([sys.executable, "-m", "pagedllm.cli", "backends", "--json"], check=True,
                         capture_output=True, text=True).stdout
    listed = {r["name"]: r for r in json.loads(out)}
    assert listed["cpu"]["kv_cache_groups"] == "reference"
    data = [r for r in rows() if r["name"] == "cpu"]
    assert "KV cache groups: core's reference allocator" in " ".join(table(data, width=400).split())


@pytest.mark.parametrize("own", [False, True])
def test_rows_report_the_allocator(own):
    ops = dict(allocate_kv_cache_groups=per_layer_allocator()) if own else {}
    b = get_backend(register_backend(make_plugin(f"kvg-rows-{own}", CAPS, **ops), f"kvg-rows-{own}").name)
    assert kv_cache_groups(b) == ("own" if own else "reference")


@pytest.mark.slow
def test_the_simulated_ascend_backend_passes_through_the_cli(tmp_path):
    """``pagedllm conformance --device ascend --simulated ...`` on the simulated torch-npu (as the support matrix is
    produced): the full + sliding and state group cases pass on core's reference allocator path; MLA is not
    declared."""
    (tmp_path / "cann").mkdir()  # the probe requires a CANN folder before it imports torch_npu
    env = dict(os.environ, PYTHONPATH=SIM + os.pathsep + os.environ.get("PYTHONPATH", ""),
               ASCEND_HOME_PATH=str(tmp_path / "cann"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "pagedllm.cli", "conformance", "--device", "ascend", "--simulated",
                    "tests/support/sim/torch_npu (simulated torch-npu ops with reference semantics)", "--allow",
                    "kv_cache.groups.*", "--report", str(tmp_path), "-q"], check=True, env=env, capture_output=True,
                   timeout=300)
    report = json.loads((tmp_path / "conformance-ascend.json").read_text())
    assert report["environment"]["kv_cache_groups"] == "reference"
    got = {(r["kernel"], r["dtype"]): r for r in report["results"] if r["kernel"].startswith("kv_cache.groups.")}
    for dtype in ("bfloat16", "float16"):
        for kernel in ("kv_cache.groups.full_sliding", "kv_cache.groups.state"):
            assert got[kernel, dtype]["status"] == "passing", got[kernel, dtype]
        assert got["kv_cache.groups.mla", dtype]["not_applicable"]
