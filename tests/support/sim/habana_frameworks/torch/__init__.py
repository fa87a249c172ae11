"""Simulated ``habana_frameworks.torch`` (tests only): ``core``, ``hpu``, ``utils`` like the real bridge."""

from habana_frameworks.torch import core, hpu, utils  # noqa: F401
from habana_frameworks.torch._sim import STATS  # noqa: F401  (sim-only introspection)
