"""``pagedllm models``: the supported-model table (native decoders, the transformers fallback, GGUF), as a terminal
table within 120 columns; ``--markdown`` prints the same rows as docs/models.md's table, ``--json`` as data."""

from __future__ import annotations

import argparse
import json
import re
import textwrap

WIDTH = 120
COLUMNS = (("Family", 15), ("Architecture", 22), ("Backends", 18), ("Quantization", 14))  # then Notes


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list supported model architectures, the backends and quantization that run them")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="rows plus every fallback architecture, as JSON")
    out.add_argument("--markdown", action="store_true", help="the table of docs/models.md")
    p.set_defaults(func=run)


def _quantization(gguf: str) -> tuple[str, str]:
    """The GGUF column's short form, and its details for the notes."""
    head, _, detail = gguf.partition(" (")
    detail = detail.rstrip(")").removeprefix("tested").lstrip("; ")
    short = {"yes": "GGUF" + (", tested" if gguf.startswith("yes (tested") else ""), "no": "-"}.get(head, "GGUF " + head)
    return short, detail


def _notes(row: dict, gguf_detail: str) -> str:
    parts = [] if row["path"].startswith("native (") or row["path"] == "native" else [row["path"]]
    parts += [row["features"]] if row["features"] != "-" else []
    parts.append(f"LoRA {row['lora']}")
    parts += [f"GGUF: {gguf_detail}"] if gguf_detail else []
    return "; ".join(parts)


def terminal_table(rows: list[dict], footer: list[str], width: int = WIDTH) -> str:
    """Rows as wrapped columns, a blank line between rows; every line fits ``width``. The architecture column widens
    to the longest name (``XLMRobertaForSequenceClassification``): a class name is never wrapped."""
    longest = max((len(r["architecture"]) for r in rows), default=0)
    columns = [(name, max(w, longest) if name == "Architecture" else w) for name, w in COLUMNS]
    notes_width = width - sum(w + 2 for _, w in columns)
    lines = ["  ".join(f"{name:<{w}}" for name, w in columns) + "  Notes", "-" * width]
    for n, r in enumerate(rows):
        if n:
            lines.append("")
        quant, detail = _quantization(r["gguf"])
        cells = [r["family"], r["architecture"], r["backends"], quant, _notes(r, detail)]
        wrapped = [textwrap.wrap(c, w, break_on_hyphens=False) or [""]
                   for c, w in zip(cells, [w for _, w in columns] + [notes_width])]
        for i in range(max(map(len, wrapped))):
            parts = [(col[i] if i < len(col) else "") for col in wrapped]
            lines.append("  ".join(f"{p:<{w}}" for p, (_, w) in zip(parts, columns)) + "  " + parts[-1])
    lines.append("")
    for text in footer:
        text = re.sub(r"\[([^]]+)\]\(#[^)]+\)", r"'\1' in docs/models.md", text.replace("`", ""))  # no markdown
        lines += textwrap.wrap(text, width, break_on_hyphens=False)
    return "\n".join(line.rstrip() for line in lines) + "\n"


def run(args: argparse.Namespace) -> int:
    # heavy: pagedllm.models, transformers
    from pagedllm.models.support import (BACKENDS_NOTE, GGUF_FORMATS, fallback_architectures, markdown_table,
                                         rows)

    if args.json:
        print(json.dumps({"models": rows(), "fallback_architectures": fallback_architectures()}, indent=2))
    elif args.markdown:
        print(markdown_table(), end="")
    else:
        others = markdown_table().rstrip("\n").split("\n\n")[1]  # the fallback line, as the doc says it
        print(terminal_table(rows(), [others, GGUF_FORMATS, BACKENDS_NOTE,
                                      "Oracle tests of each family: docs/models.md, or pagedllm models --json."]),
              end="")
    return 0
