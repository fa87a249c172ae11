"""docs/models.md's supported-model table is exactly what ``pagedllm models`` generates from the code."""

from __future__ import annotations

import re
from pathlib import Path

from pagedllm.backend.hookspec import Capabilities
from pagedllm.backend.registry import discover, register_backend
from pagedllm.cli import main
from pagedllm.models.support import markdown_table
from plugin_factory import make_plugin

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_models_doc_table_is_generated(capsys):
    text = DOC.read_text()
    block = re.search(r"<!-- BEGIN GENERATED: pagedllm models -->\n(.*?)<!-- END GENERATED -->", text, re.S)
    assert block, "docs/models.md lost its generated-table markers"
    assert main(["models", "--markdown"]) == 0
    printed = capsys.readouterr().out
    assert printed == markdown_table()
    assert block.group(1) == printed, "regenerate the table with `pagedllm models --markdown`"


def test_models_table_ignores_backends_registered_in_process():
    """The generated table names installed backends (entry points) only: a backend a test or notebook registers in
    process must not change docs/models.md (it did, by test order, in CI)."""
    before = markdown_table()
    register_backend(make_plugin("in-process-only", Capabilities(dtypes=("float32",), head_sizes=None)),
                     "in-process-only")
    try:
        assert markdown_table() == before
    finally:
        discover().pop("in-process-only", None)
