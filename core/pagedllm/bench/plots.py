"""PNG charts of a ``bench sweep`` (matplotlib, headless): throughput, TTFT and TPOT percentiles vs request rate,
and the end-to-end latency CDF (one panel per ``max_num_seqs``).

Every chart names the run it shows (model, device, dtype, prompt/output lengths, commit: :func:`settings_text`), so
a PNG read on its own says what was measured. Request rates are on a log axis (``inf``, all requests at once, sits
one step past the highest finite rate); latencies are in ms; each rate keeps one colour in every CDF panel.
"""

from __future__ import annotations

import math
import os

import numpy as np

from pagedllm.errors import ParamError

FIGSIZE, DPI = (8.0, 5.0), 100  # every chart is 800 x 500 pixels
RATE_AXIS = "request rate (req/s, Poisson, log scale; inf = all at once)"


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:

        raise ParamError("plot", "needs matplotlib: pip install matplotlib") from None


def _is_inf(rate) -> bool:
    return rate == "inf" or (isinstance(rate, float) and math.isinf(rate))


def _rate_label(rate) -> str:
    return "inf" if _is_inf(rate) else f"{float(rate):g}"


def rate_positions(rows: list[dict]) -> dict[str, float]:
    """x of each rate on the log axis: finite rates at their value, ``inf`` 4x past the highest (1 if alone)."""
    finite = sorted({float(r["request_rate"]) for r in rows if not _is_inf(r["request_rate"])})
    out = {_rate_label(v): v for v in finite}
    if any(_is_inf(r["request_rate"]) for r in rows):
        out["inf"] = finite[-1] * 4 if finite else 1.0
    return out


def _groups(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(r["max_num_seqs"], []).append(r)
    return out


def _name(mns) -> str:
    return "server default" if mns is None else f"max_num_seqs={mns}"


def settings_text(rows: list[dict]) -> str:
    """The run's settings, two short lines under each chart's title: what the chart is of."""
    r = rows[0] if rows else {}
    model = str(r.get("model") or "?")
    model = os.path.basename(model.rstrip("/")) or model
    return (f"{model} | device {r.get('device', '?')} | dtype {r.get('dtype', '?')}\n"
            f"prompt {r.get('input_len', '?')} / output {r.get('output_len', '?')} tokens, "
            f"{r.get('num_prompts', '?')} requests per point | commit {r.get('commit', '?')}")


def sweep_figures(rows: list[dict]) -> dict:
    """The four charts as matplotlib figures, by file name (the caller saves and closes them)."""
    import matplotlib  # optional: matplotlib (pagedllm[bench])

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib (pagedllm[bench])

    xs = rate_positions(rows)
    ticks = sorted(xs.items(), key=lambda kv: kv[1])
    colour = {label: plt.get_cmap("tab10")(i % 10) for i, (label, _) in enumerate(ticks)}
    subtitle = settings_text(rows)
    figs: dict = {}

    def rate_axis(ax) -> None:
        ax.set_xscale("log")
        ax.set_xticks([x for _, x in ticks], [label for label, _ in ticks])
        ax.minorticks_off()
        ax.set_xlabel(RATE_AXIS)

    def finish(fig, name: str, title: str) -> None:
        fig.suptitle(title, fontsize="large", y=0.985)
        fig.text(0.5, 0.935, subtitle, ha="center", va="top", fontsize="small", color="0.3", linespacing=1.4)
        for ax in fig.axes:
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
        fig.tight_layout(rect=(0, 0, 1, 0.875))
        figs[name] = fig

    fig, ax = plt.subplots(figsize=FIGSIZE)
    for mns, rs in _groups(rows).items():
        ax.plot([xs[_rate_label(r["request_rate"])] for r in rs], [r["output_throughput"] for r in rs], "o-",
                label=_name(mns))
    rate_axis(ax)
    ax.set_ylabel("output tokens/s")
    finish(fig, "throughput.png", "Output throughput vs request rate")

    for metric, title in (("ttft", "Time to first token"), ("tpot", "Time per output token")):
        fig, ax = plt.subplots(figsize=FIGSIZE)
        for mns, rs in _groups(rows).items():
            x = [xs[_rate_label(r["request_rate"])] for r in rs]
            line, = ax.plot(x, [r[f"median_{metric}_ms"] for r in rs], "o-", label=f"p50, {_name(mns)}")
            ax.plot(x, [r[f"p99_{metric}_ms"] for r in rs], "s--", color=line.get_color(),
                    label=f"p99, {_name(mns)}")
        rate_axis(ax)
        ax.set_ylabel(f"{metric.upper()} (ms)")
        finish(fig, f"{metric}.png", f"{title} (p50 and p99) vs request rate")

    groups = _groups(rows)
    fig, axes = plt.subplots(1, len(groups), figsize=FIGSIZE, sharey=True, squeeze=False)
    for ax, (mns, rs) in zip(axes[0], groups.items()):
        for r in rs:
            lat = np.sort(np.asarray(r.get("e2el_samples_ms") or [], dtype=float))
            if lat.size:
                label = _rate_label(r["request_rate"])
                ax.step(lat, np.arange(1, lat.size + 1) / lat.size, where="post", color=colour[label],
                        label=f"rate {label}")
        ax.set_ylim(0, 1.02)
        ax.set_title(_name(mns), fontsize="medium")
        ax.set_xlabel("end-to-end latency (ms)")
    axes[0][0].set_ylabel("fraction of requests")
    finish(fig, "latency_cdf.png", "End-to-end request latency CDF")
    return figs


def plot_sweep(rows: list[dict], out_dir: str) -> list[str]:
    """Write throughput.png, ttft.png, tpot.png and latency_cdf.png into ``out_dir``; return their paths."""
    import matplotlib.pyplot as plt  # optional: matplotlib (pagedllm[bench])

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, fig in sweep_figures(rows).items():
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        paths.append(path)
    return paths
