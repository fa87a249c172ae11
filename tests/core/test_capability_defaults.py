"""Optional features are off unless a backend states them: one that forgets claims nothing it lacks."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from pagedllm.backend import Capabilities, ModelInfo, ParamError, ref_ops
from pagedllm.backend.registry import Backend
from pagedllm.config import EngineConfig, resolve_config
from plugin_factory import make_plugin

INFO = ModelInfo("MistralForCausalLM", "float32", 2, 4, 2, 64, 512, 512)


def test_optional_features_default_to_off():
    caps = Capabilities()
    assert not (caps.sliding_window or caps.soft_cap or caps.mla or caps.alibi or caps.on_device_sampling)


@pytest.mark.parametrize("need,match", [({"sliding_window": 8}, "sliding-window"), ({"soft_cap": 30.0}, "soft-capping"),
                                        ({"mla": True}, "multi-head latent attention")])
def test_a_backend_that_forgets_a_feature_refuses_its_models(need, match):
    """Its own attention, capabilities that do not mention the feature: refused before any weight is read."""
    be = Backend(make_plugin("forgetful", Capabilities(head_sizes=(64,)), paged_attention=ref_ops.paged_attention,
                             allocate_kv_cache=lambda spec: []), "forgetful")
    with pytest.raises(ParamError, match=match):
        resolve_config(EngineConfig(), be, replace(INFO, **need))


def _without_capabilities(**ops) -> Backend:
    plugin = make_plugin("nocaps", **ops)
    return Backend(SimpleNamespace(**{k: v for k, v in vars(plugin).items() if k != "pagedllm_capabilities"}), "nocaps")


def test_without_a_capabilities_hook_the_reference_ops_features_are_declared():
    """A backend leaving capabilities to core claims what core's reference ops run for it, and only that."""
    ref = _without_capabilities().capabilities
    assert ref.sliding_window and ref.soft_cap and ref.mla and ref.alibi
    own = _without_capabilities(paged_attention=ref_ops.paged_attention, write_mla_kv=ref_ops.write_mla_kv).capabilities
    assert not (own.sliding_window or own.soft_cap or own.mla or own.alibi)
