"""Start-up refusal of a model with recurrent state that the backend cannot run (issue 28): a state-op family
(``Capabilities.state_ops``) or a state dtype (``Capabilities.state_dtypes``) its layers need and the backend does
not declare. Called by ``config.resolve_config`` once the engine dtype is known, before any weight is read."""

from __future__ import annotations

from pagedllm.backend.hookspec import Capabilities, ModelInfo
from pagedllm.errors import ParamError

#: What each family of ``Capabilities.state_ops`` computes, for the refusal
OP_NAMES = {"conv": "causal conv1d", "ssm": "the Mamba2 selective scan", "delta_rule": "the gated delta rule"}


def check_state_support(info: ModelInfo, caps: Capabilities, backend_name: str, dtype: str) -> None:
    """Raise :class:`ParamError` (field ``model``) naming the first state layer type whose op family or state dtype
    (``auto``: ``dtype``, the engine's) backend ``backend_name`` does not declare; ``None`` capabilities declare all."""
    for layer in info.state:
        if caps.state_ops is not None:
            missing = [op for op in layer.ops if op not in caps.state_ops]
            if missing:
                ops = ", ".join(f"{op} ({OP_NAMES.get(op, op)})" for op in missing)
                have = ", ".join(caps.state_ops) or "none"
                raise ParamError("model", f"{info.architecture}'s {layer.layer_type!r} layers keep recurrent state "
                                          f"through the {ops} state op(s), which backend {backend_name!r} does not "
                                          f"run (Capabilities.state_ops: {have})")
        if caps.state_dtypes is not None:
            for want in (dtype if d == "auto" else d for d in layer.dtypes):
                if want not in caps.state_dtypes:
                    raise ParamError("model", f"{info.architecture}'s {layer.layer_type!r} layers keep a {want} "
                                              f"recurrent state, which backend {backend_name!r} does not hold "
                                              f"(Capabilities.state_dtypes: {', '.join(caps.state_dtypes)})")
