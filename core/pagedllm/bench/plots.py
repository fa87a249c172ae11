"""PNG charts of a ``bench sweep`` (matplotlib, headless): throughput, TTFT and TPOT percentiles vs request rate,
and the end-to-end latency CDF. One line per ``max_num_seqs`` value; rates are categories so ``inf`` has a place.
"""

from __future__ import annotations

import math
import os

import numpy as np

from pagedllm.errors import ParamError

FIGSIZE, DPI = (8.0, 5.0), 100  # every chart is 800 x 500 pixels


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:

        raise ParamError("plot", "needs matplotlib: pip install matplotlib") from None


def _rate_label(rate) -> str:
    return "inf" if rate == "inf" or (isinstance(rate, float) and math.isinf(rate)) else f"{float(rate):g}"


def _groups(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(r["max_num_seqs"], []).append(r)
    return out


def _name(mns) -> str:
    return "server default" if mns is None else f"max_num_seqs={mns}"


def plot_sweep(rows: list[dict], out_dir: str) -> list[str]:
    """Write throughput.png, ttft.png, tpot.png and latency_cdf.png into ``out_dir``; return their paths."""
    import matplotlib  # optional: matplotlib (pagedllm[bench])

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib (pagedllm[bench])

    os.makedirs(out_dir, exist_ok=True)
    labels = list(dict.fromkeys(_rate_label(r["request_rate"]) for r in rows))
    x = {lab: i for i, lab in enumerate(labels)}
    paths = []

    def finish(fig, ax, name: str, ylabel: str, xlabel: str = "request rate (req/s, Poisson; inf = all at once)"):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=FIGSIZE)
    for mns, rs in _groups(rows).items():
        ax.plot([x[_rate_label(r["request_rate"])] for r in rs], [r["output_throughput"] for r in rs], "o-",
                label=_name(mns))
    ax.set_xticks(range(len(labels)), labels)
    ax.set_title("Output throughput vs request rate")
    finish(fig, ax, "throughput.png", "output tokens/s")

    for metric, title in (("ttft", "Time to first token"), ("tpot", "Time per output token")):
        fig, ax = plt.subplots(figsize=FIGSIZE)
        for mns, rs in _groups(rows).items():
            xs = [x[_rate_label(r["request_rate"])] for r in rs]
            line, = ax.plot(xs, [r[f"median_{metric}_ms"] for r in rs], "o-", label=f"p50, {_name(mns)}")
            ax.plot(xs, [r[f"p99_{metric}_ms"] for r in rs], "s--", color=line.get_color(),
                    label=f"p99, {_name(mns)}")
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(f"{title} (p50 and p99) vs request rate")
        finish(fig, ax, f"{metric}.png", "milliseconds")

    fig, ax = plt.subplots(figsize=FIGSIZE)
    for r in rows:
        lat = np.sort(np.asarray(r.get("e2el_samples_ms") or [], dtype=float))
        if lat.size:
            ax.step(lat, np.arange(1, lat.size + 1) / lat.size, where="post",
                    label=f"rate {_rate_label(r['request_rate'])}, {_name(r['max_num_seqs'])}")
    ax.set_ylim(0, 1.02)
    ax.set_title("End-to-end request latency CDF")
    finish(fig, ax, "latency_cdf.png", "fraction of requests", xlabel="end-to-end latency (ms)")
    return paths
