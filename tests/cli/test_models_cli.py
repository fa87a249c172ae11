"""``pagedllm models`` is a readable terminal table within 120 columns (family, architecture, backends,
quantization, notes) with the same rows and notes as docs/models.md's generated table, which says which GGUF
formats run packed and which are dequantized."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from pagedllm.models.support import GGUF_FORMATS, rows

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def _doc_rows() -> list[list[str]]:
    block = re.search(r"<!-- BEGIN GENERATED: pagedllm models -->\n(.*?)<!-- END GENERATED -->", DOC.read_text(), re.S)
    lines = [line for line in block.group(1).splitlines() if line.startswith("| ")]
    return [[c.strip().strip("`") for c in line.strip("|").split("|")] for line in lines]


def test_models_is_a_terminal_table_matching_the_doc():
    p = subprocess.run([sys.executable, "-m", "pagedllm.cli", "models"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert max(map(len, lines)) <= 120, max(lines, key=len)
    assert lines[0].split() == ["Family", "Architecture", "Backends", "Quantization", "Notes"], lines[0]
    assert "|" not in p.stdout, "markdown, not a terminal table"

    header, *doc = _doc_rows()
    assert header[:4] == ["Family", "Architecture", "Path", "Backends"] and "GGUF" in header
    assert not any("dequantized at load" in h for h in header), "the GGUF column is not all dequantized"
    cell = {name: header.index(name) for name in header}
    starts = [re.split(r"\s{2,}", line.strip()) for line in lines[2:] if line and not line.startswith(" ")]
    by_arch = {s[1]: s for s in starts if len(s) > 2}
    assert [r[cell["Architecture"]] for r in doc] == [r["architecture"] for r in rows()]
    for r in doc:  # each doc row is a terminal row: same family (first line of it), architecture, backends
        term = by_arch[r[cell["Architecture"]]]
        assert r[cell["Family"]].startswith(term[0]) and r[cell["Backends"]].startswith(term[2]), (r, term)

    flat = " ".join(p.stdout.split())
    assert " ".join(GGUF_FORMATS.replace("`", "").split()) in flat
    assert GGUF_FORMATS in DOC.read_text()
    assert "Q4_0 and Q4_1 linears run packed on cpu" in GGUF_FORMATS and "dequantized at load" in GGUF_FORMATS
