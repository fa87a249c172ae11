"""pagedllm backends for Intel hardware (distribution ``pagedllm-xpu``).

* ``xpu`` (:mod:`pagedllm_xpu.plugin`): Intel GPUs through stock ``torch.xpu`` — core's portable Triton kernels,
  XPU graphs for decode through core's graph runner, ``xccl`` collectives.
* ``ipex`` (:mod:`pagedllm_xpu.ipex_plugin`): Intel CPUs through ``ipex.llm.modules.PagedAttention`` when an
  intel-extension-for-pytorch build for this torch's major.minor is installed (:mod:`pagedllm_xpu.vendor`).

Importing this package, or either plugin module, imports neither Triton nor IPEX. Not verified on hardware.
"""

__version__ = "0.2.0"
