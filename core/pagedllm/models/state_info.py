"""``state_layer_info``: the recurrent-state layer kinds of a native stateful family, read from its config before
any weight is loaded (``ModelInfo.state``), so a backend that lacks a state op or dtype refuses the model at start-up
(``backend/state_capability.py``). Each entry says what the family's ``state_dtypes`` allocate (checked against the
loaded models in tests/core/test_state_capability.py)."""

from __future__ import annotations

from typing import Any

from pagedllm.backend.hookspec import StateLayerInfo
from pagedllm.models.arch import architecture_of

#: module -> its state layer kind: LFM2's short convolution keeps the conv input in the model dtype; Mamba2 (pure
#: and in Granite-4.0-H) keeps conv and SSM states in the model dtype (vLLM's default mamba_ssm_cache_dtype);
#: Gated DeltaNet keeps its conv state in the model dtype and the delta-rule state in float32.
STATE_LAYERS = {
    "lfm2": StateLayerInfo("conv", ("conv",), ("auto",)),
    "mamba2": StateLayerInfo("mamba", ("conv", "ssm"), ("auto", "auto")),
    "granite_hybrid": StateLayerInfo("mamba", ("conv", "ssm"), ("auto", "auto")),
    "qwen3_next": StateLayerInfo("linear_attention", ("conv", "delta_rule"), ("auto", "float32")),
}


def state_layer_info(config: Any) -> tuple[StateLayerInfo, ...]:
    """The state layer kinds of a natively run model (one per family: each family has a single kind); () for a
    model without state."""
    layer = STATE_LAYERS.get(architecture_of(config)[1].module)
    return (layer,) if layer is not None else ()
