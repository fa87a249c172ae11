"""A FAKE intel_extension_for_pytorch for tests (tests/support/sim/xpu): ``llm.modules.PagedAttention`` implemented with
pagedllm's reference ops. Only ever on PYTHONPATH of a test subprocess."""

from intel_extension_for_pytorch._version import __version__  # noqa: F401  (written by sim_xpu.fake_ipex)
from intel_extension_for_pytorch import llm  # noqa: F401
