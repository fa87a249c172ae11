"""docs/models.md's supported-model table is exactly what ``pagedllm models`` generates from the code."""

from __future__ import annotations

import re
from pathlib import Path

from pagedllm.cli import main
from pagedllm.models.support import markdown_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_models_doc_table_is_generated(capsys):
    text = DOC.read_text()
    block = re.search(r"<!-- BEGIN GENERATED: pagedllm models -->\n(.*?)<!-- END GENERATED -->", text, re.S)
    assert block, "docs/models.md lost its generated-table markers"
    assert main(["models", "--markdown"]) == 0
    printed = capsys.readouterr().out
    assert printed == markdown_table()
    assert block.group(1) == printed, "regenerate the table with `pagedllm models --markdown`"
