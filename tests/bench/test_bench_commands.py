"""Every module of ``BENCHES`` registers one ``pagedllm bench`` subcommand whose ``--help`` works (in-process: one
parser, no subprocess per name); the peer scripts run under other venvs import nothing of pagedllm."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import json
from pathlib import Path

import pytest
from pagedllm.cli import build_parser
from pagedllm.commands.bench import BENCHES


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_bench_module_registers_its_subcommand():
    cli_benches = _subcommands(_subcommands(build_parser())["bench"])
    names = []
    for mod in BENCHES:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(mod).add_parser(sub)
        assert len(sub.choices) == 1, (mod, list(sub.choices))
        names += list(sub.choices)
    assert sorted(names) == sorted(cli_benches), "BENCHES and `pagedllm bench` disagree"
    parser = build_parser()
    for name in names:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
            parser.parse_args(["bench", name, "--help"])
        assert e.value.code == 0, name
        assert f"pagedllm bench {name}" in out.getvalue(), name
        assert cli_benches[name].get_default("func") is not None, f"bench {name} sets no func"


@pytest.mark.parametrize("script", ["llama_cpp_peer.py", "vllm_peer.py"])
def test_peer_scripts_import_no_pagedllm(script):
    import pagedllm.bench

    tree = ast.parse((Path(pagedllm.bench.__file__).parent / script).read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m.split(".")[0] == "pagedllm"], imported


def test_quant_summary_table(tmp_path):
    """``bench quant``'s table: one row per configuration, rounds ``/``-separated, then the llama.cpp lines."""
    from pagedllm.bench.quant import summary

    for cfg, rate in (("fp32", 30.0), ("bf16", 50.0), ("q4_1", 100.0), ("w8a8", 31.0)):
        for r in (1, 2):
            run = {"output_tok_s": rate + r, "peak_rss_mb": 500.4, "cold_start_s": 2.26}
            (tmp_path / f"b1-{cfg}-{r}.json").write_text(json.dumps(run))
            (tmp_path / f"b64-{cfg}-{r}.json").write_text(json.dumps({**run, "output_tok_s": 10 * rate}))
    (tmp_path / "llamacpp-1.json").write_text(json.dumps({"median_decode_tok_s": 110.44, "load_s": 0.123}))
    lines = summary(str(tmp_path)).splitlines()
    assert lines[2] == "| fp32 | 31.0 / 32.0 | 300 / 300 | 500 / 500 | 2.3 / 2.3 |"
    assert [line.split(" | ")[0] for line in lines[2:6]] == ["| fp32", "| bf16", "| q4_1", "| w8a8"]
    assert lines[6] == "llama.cpp (gpt4all 2.8.2): decode median 110.4 tok/s, load 0.12 s"
