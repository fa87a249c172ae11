"""Build small in-process backend plugins for tests: the required hooks plus whatever op hooks a test passes."""

from __future__ import annotations

from types import SimpleNamespace

from pagedllm.backend.hookspec import BackendInfo, Capabilities, MemoryInfo, ProbeResult, hookimpl


#: What core's reference ops run: a plugin that leaves attention and MLA to them states these features.
REFERENCE_FEATURES = dict(sliding_window=True, soft_cap=True, mla=True)


def make_plugin(name: str, caps: Capabilities = Capabilities(**REFERENCE_FEATURES), device_name: str = "cpu",
                **ops) -> SimpleNamespace:
    """A CPU backend plugin: required hooks, ``caps``, and ``ops`` as ``pagedllm_<key>`` hooks (others fall back
    to core's reference ops)."""
    @hookimpl
    def pagedllm_backend_info():
        return BackendInfo(name=name, device_type="cpu")

    @hookimpl
    def pagedllm_probe():
        return ProbeResult(True, device_name=device_name)

    @hookimpl
    def pagedllm_capabilities():
        return caps

    @hookimpl
    def pagedllm_memory_info(device):
        return MemoryInfo(total_bytes=8 << 30, free_bytes=4 << 30)

    hooks = {f"pagedllm_{k}": hookimpl(v) for k, v in ops.items()}
    return SimpleNamespace(pagedllm_backend_info=pagedllm_backend_info, pagedllm_probe=pagedllm_probe,
                           pagedllm_capabilities=pagedllm_capabilities, pagedllm_memory_info=pagedllm_memory_info,
                           **hooks)
