"""``pagedllm bench sweep``: one real server per max_num_seqs value, bench serve per request rate, JSON + CSV, and
``--plot`` PNG charts that are real images of the documented size."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

from PIL import Image

from server_utils import tiny_chat_model

CHARTS = ("throughput.png", "ttft.png", "tpot.png", "latency_cdf.png")


def test_sweep_writes_results_and_charts(tmp_path):
    out, plots = tmp_path / "out", tmp_path / "plots"
    p = subprocess.run(
        [sys.executable, "-m", "pagedllm.cli", "bench", "sweep", "--model", tiny_chat_model(), "--serve-args",
         "--device cpu", "--request-rates", "16", "inf", "--max-num-seqs", "2", "8", "--num-prompts", "6",
         "--input-len", "40", "--output-len", "6", "--output-dir", str(out), "--plot", str(plots)],
        capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = json.loads((out / "sweep.json").read_text())
    assert [(r["max_num_seqs"], r["request_rate"]) for r in rows] == [(2, 16.0), (2, "inf"), (8, 16.0), (8, "inf")]
    for r in rows:
        assert r["completed"] == 6 and r["failed"] == 0
        assert r["total_output_tokens"] == 6 * 6 and r["output_throughput"] > 0
        assert len(r["e2el_samples_ms"]) == 6 and r["median_ttft_ms"] <= r["p99_ttft_ms"]
        # every point (and its warm-up) has prompts of its own: 40 tokens are two full 16-token blocks the prefix
        # cache would hit if a point reused the warm-up's or an earlier point's prompts on the same server
        assert r["prefix_cache_queries"] == 6 * 40 and r["prefix_cache_hits"] == 0, r
    with open(out / "sweep.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4 and float(table[0]["output_throughput"]) == rows[0]["output_throughput"]
    for name in CHARTS:
        with Image.open(plots / name) as im:
            im.verify()  # a whole, valid PNG
        with Image.open(plots / name) as im:
            assert im.format == "PNG" and im.size == (800, 500), (name, im.format, im.size)
            assert len(im.convert("L").getcolors(maxcolors=1 << 16) or ()) > 20, f"{name} looks blank"
    _check_figures(rows, "cpu", "tiny-chat-llama")


def _check_figures(rows: list[dict], device: str, model: str) -> None:
    """Each chart says what run it shows; TTFT/TPOT are in ms over a log rate axis; a rate keeps its colour in every
    CDF panel (one panel per max_num_seqs)."""
    from matplotlib.colors import to_hex

    from pagedllm.bench import plots
    from pagedllm.bench.sweep import source_commit

    for r in rows:
        assert r["device"] == device and r["dtype"] == "auto" and r["commit"] == source_commit(), r
    figs = plots.sweep_figures(rows)
    try:
        assert set(figs) == set(CHARTS)
        for name, fig in figs.items():
            text = " ".join(t.get_text() for t in fig.texts)
            for word in (model, f"device {device}", "dtype auto", f"prompt {rows[0]['input_len']} / output "
                         f"{rows[0]['output_len']} tokens", f"commit {rows[0]['commit']}"):
                assert word in text, (name, word, text)
        for name in ("ttft.png", "tpot.png", "throughput.png"):
            ax = figs[name].axes[0]
            assert ax.get_xscale() == "log", name
            assert [t.get_text() for t in ax.get_xticklabels()] == ["16", "inf"], name
        assert figs["ttft.png"].axes[0].get_ylabel() == "TTFT (ms)"
        assert figs["tpot.png"].axes[0].get_ylabel() == "TPOT (ms)"
        panels = figs["latency_cdf.png"].axes
        assert [ax.get_title() for ax in panels] == ["max_num_seqs=2", "max_num_seqs=8"]
        colours = [{line.get_label(): to_hex(line.get_color()) for line in ax.get_lines()} for ax in panels]
        assert colours[0] == colours[1] and set(colours[0]) == {"rate 16", "rate inf"}, colours
        assert len(set(colours[0].values())) == 2, colours
    finally:
        import matplotlib.pyplot as plt

        for fig in figs.values():
            plt.close(fig)
