"""The CPU backend's int8-activation switch, set for one test: ``PAGEDLLM_CPU_INT8_ACT`` is decided once per process
(``pagedllm_cpu.quant.int8_act_rows``), so a test sets the variable and makes the backend decide again."""

from __future__ import annotations

from typing import Union

import pytest


def use_int8_activations(monkeypatch: pytest.MonkeyPatch, value: Union[bool, str]) -> None:
    """``PAGEDLLM_CPU_INT8_ACT`` = "1" / "0" (or a raw value, to test its parsing), decided afresh on next use."""
    from pagedllm_cpu import quant

    monkeypatch.setenv("PAGEDLLM_CPU_INT8_ACT", value if isinstance(value, str) else ("1" if value else "0"))
    monkeypatch.setattr(quant, "_int8_act_config", None)
