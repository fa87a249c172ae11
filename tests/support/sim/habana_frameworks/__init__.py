"""SIMULATED ``habana_frameworks`` for pagedllm's tests: never shipped, never a Gaudi.

Implements only what ``pagedllm_gaudi`` calls, with reference semantics on host tensors (run with
``VLLM_USE_FAKE_HPU=1``): ``torch.core.mark_step`` (counted), ``torch.hpu.HPUGraph`` / ``graph`` (records the ops of
the captured region with a TorchDispatchMode and replays them on the same tensors, refusing host syncs and
data-dependent shapes during capture, as the real HPU graphs do), memory queries (process RSS stands in for HBM),
``torch.utils.internal.is_lazy``. Put ``tests/support/sim`` on PYTHONPATH in a subprocess to use it.
"""
