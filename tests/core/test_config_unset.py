"""Fields a backend may adjust are None until the user sets them: ``update_config`` tells a choice from a default."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedllm.backend import Capabilities, ModelInfo
from pagedllm.backend.registry import Backend
from pagedllm.commands.engine_args import add_engine_args, engine_config
from pagedllm.config import BACKEND_SETTABLE, DEFAULT_MAX_NUM_SEQS, EngineConfig, resolve_config
from plugin_factory import make_plugin

INFO = ModelInfo("LlamaForCausalLM", "float32", 2, 4, 2, 64, 512, 512)
UNSET = {"block_size": None, "dtype": "auto", "max_num_batched_tokens": None, "max_num_seqs": None,
         "enforce_eager": None}


def _resolve_seeing(config: EngineConfig) -> tuple[dict, EngineConfig]:
    seen: dict = {}

    def update_config(config, model_info):
        seen.update((f, getattr(config, f)) for f in BACKEND_SETTABLE)

    be = Backend(make_plugin("watcher", Capabilities(head_sizes=(64,)), update_config=update_config), "watcher")
    return seen, resolve_config(config, be, INFO)


def test_update_config_sees_none_when_the_user_set_nothing_then_core_fills_the_defaults():
    seen, cfg = _resolve_seeing(EngineConfig())
    assert seen == UNSET
    assert (cfg.max_num_seqs, cfg.enforce_eager, cfg.block_size, cfg.dtype) == (DEFAULT_MAX_NUM_SEQS, False, 16,
                                                                                "float32")
    assert cfg.max_num_batched_tokens == 2048


@pytest.mark.parametrize("field,value", [("max_num_seqs", 256), ("max_num_seqs", 3), ("enforce_eager", False),
                                         ("enforce_eager", True), ("max_num_batched_tokens", 4096),
                                         ("block_size", 16), ("dtype", "float32")])
def test_update_config_sees_the_users_value_even_when_it_equals_the_default(field, value):
    seen, cfg = _resolve_seeing(EngineConfig(**{field: value}))
    assert seen == {**UNSET, field: value}
    assert getattr(cfg, field) == value


@pytest.mark.parametrize("config,architecture,runner", [
    (EngineConfig(), "LlamaForCausalLM", "generate"),
    (EngineConfig(), "BertModel", "pooling"),
    (EngineConfig(convert="embed"), "LlamaForCausalLM", "pooling"),
    (EngineConfig(runner="generate"), "LlamaForCausalLM", "generate"),
])
def test_update_config_sees_the_runner_resolved(config, architecture, runner):
    """A backend's defaults may depend on the runner (the CPU plugin's step budget is for generation only)."""
    seen: dict = {}

    def update_config(config, model_info):
        seen.update(runner=config.runner)

    be = Backend(make_plugin("watcher", Capabilities(head_sizes=(64,)), update_config=update_config), "watcher")
    resolved = resolve_config(config, be, dataclasses.replace(INFO, architecture=architecture))
    assert seen == {"runner": runner} and resolved.runner == runner
    assert config.runner in ("auto", "generate")  # the caller's config is not changed


def test_cli_leaves_unset_flags_none_and_documents_the_default():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_config(parser.parse_args([]))
    assert (cfg.max_num_seqs, cfg.enforce_eager, cfg.block_size, cfg.max_num_batched_tokens) == (None,) * 4
    assert engine_config(parser.parse_args(["--max-num-seqs", "256", "--enforce-eager"])).max_num_seqs == 256
    assert f"default: {DEFAULT_MAX_NUM_SEQS}" in parser.format_help()
