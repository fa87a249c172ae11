"""docs/writing-a-backend.md runs as written: every Python block executes, and its static-shape walk-through is a
backend that core's conformance suite passes (PASS: every applicable case ran and passed)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from pagedllm.backend.registry import discover

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-a-backend.md"
#: The section whose blocks are one module, in order (the doc says so); its blocks that import it are scripts.
WALK_THROUGH = "## Walk-through: a static-shape backend"
MODULE = "acme_static"


def python_blocks(text: str) -> list[tuple[str, str]]:
    """``(section heading, code)`` of every fenced ``python`` block, in document order."""
    blocks: list[tuple[str, str]] = []
    section, fence, code = "", None, []
    for line in text.splitlines(keepends=True):
        if fence is not None:
            if line.startswith("```"):
                if fence == "python":
                    blocks.append((section, "".join(code)))
                fence, code = None, []
            else:
                code.append(line)
        elif line.startswith("```"):
            fence = line[3:].strip()
        elif line.startswith("## "):
            section = line.strip()
    return blocks


BLOCKS = python_blocks(DOC.read_text())
WALK = [code for section, code in BLOCKS if section == WALK_THROUGH]
SCRIPTS = [code for code in WALK if f"import {MODULE}" in code]
OTHERS = [(i, code) for i, (section, code) in enumerate(BLOCKS) if section != WALK_THROUGH]


def run_block(code: str, name: str) -> dict:
    """Execute one block in a fresh namespace, as a script would run."""
    namespace = {"__name__": "__main__"}
    exec(compile(code, f"{DOC.name}:{name}", "exec"), namespace)
    return namespace


def test_the_doc_has_the_blocks_this_test_runs():
    assert len(WALK) >= 3 and len(SCRIPTS) == 1 and OTHERS, [s for s, _ in BLOCKS]


def test_plugin_code_imports_only_the_public_backend_api():
    """What a vendor copies into a plugin names nothing of pagedllm outside ``pagedllm.backend``."""
    for section, code in BLOCKS:
        if "@hookimpl" not in code:
            continue  # a script (conformance), not plugin code
        for node in ast.walk(ast.parse(code)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                public = name.split(".")[:2] == ["pagedllm", "backend"]
                assert public or not name.startswith("pagedllm"), (section, name)


@pytest.mark.parametrize("index,code", OTHERS, ids=[f"block{i}" for i, _ in OTHERS])
def test_block_runs_as_written(index, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_block(code, f"block{index}")


def test_static_walk_through_is_a_backend_that_passes_conformance(tmp_path, monkeypatch):
    """The walk-through's blocks saved as ``acme_static.py``; its script registers it and asserts PASS."""
    (tmp_path / f"{MODULE}.py").write_text("\n\n".join(code for code in WALK if code not in SCRIPTS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    try:
        report = run_block(SCRIPTS[0], "walk-through script")["report"]
        assert report.status == "PASS"
        ran = {r.kernel for r in report.results if r.status == "passing"}
        assert {"greedy_parity_vs_hf", "graph_runner.replay_vs_eager", "buckets_only_and_equal_to_dynamic"} <= ran
        assert (tmp_path / "conformance-out" / "conformance-acme-static.md").exists()
    finally:
        sys.modules.pop(MODULE, None)
        discover().pop("acme-static", None)
