"""PNG figures of a benchmark run (matplotlib is optional: ``pip install 'triflash[bench]'``).

* fwd / bwd / fwdbwd: one figure per (mode, dtype, head_dim, causal) with four panels, latency,
  TFLOP/s, speedup over naive and peak memory, against the sequence length (log2 axis), one line per
  provider. A run with a single sequence length gets bar charts instead of one-point lines.
* decode: one figure per (dtype, head_dim): GB/s and microseconds per call against the context
  length, one column per batch size.

Only results that passed the check and were timed are drawn; the tables list the others.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from .report import group_title, grouped
from .runner import Result
from .workloads import PAGE_SIZE

# A fixed colour and marker per provider, so every figure reads the same way.
PROVIDER_ORDER = ["triflash", "triflash-paged", "naive", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient",
                  "sdpa-math", "fa2", "fa3", "fa4", "fa4-paged", "flashinfer"]
COLORS = {"triflash": "#d62728", "triflash-paged": "#d62728", "naive": "#7f7f7f",
          "sdpa-flash": "#1f77b4", "sdpa-cudnn": "#17becf", "sdpa-efficient": "#2ca02c",
          "sdpa-math": "#bcbd22", "fa2": "#9467bd", "fa3": "#e377c2", "fa4": "#8c564b",
          "fa4-paged": "#8c564b", "flashinfer": "#ff7f0e"}
MARKERS = "os^Dv<>pP*Xh"



class Panel(NamedTuple):
    title: str
    ylabel: str
    value: Callable[[Result], float | None]
    log_y: bool = False
    baseline: float | None = None          # a dotted horizontal line (speedup = 1)
    band: Callable[[Result], tuple[float, float] | None] | None = None    # p20-p80, drawn as error bars


def _p20_p80(r: Result, scale: float = 1.0):
    return (r.ms_p20 * scale, r.ms_p80 * scale) if r.ms_p20 is not None and r.ms_p80 is not None else None


DENSE_PANELS = [
    Panel("Latency (bars: p20-p80)", "median ms (lower is better)", lambda r: r.ms, log_y=True, band=_p20_p80),
    Panel("Throughput", "TFLOP/s", lambda r: r.tflops),
    Panel("Speedup over naive PyTorch", "speedup (x naive)", lambda r: r.speedup_naive, baseline=1.0),
    Panel("Peak extra memory", "MiB", lambda r: r.peak_mib, log_y=True),
]
DECODE_PANELS = [
    Panel("K/V read bandwidth", "GB/s", lambda r: r.gbps),
    Panel("Latency (bars: p20-p80)", "us per call (lower is better)", lambda r: r.ms * 1e3, log_y=True,
          band=lambda r: _p20_p80(r, 1e3)),
]


def plot_results(results: list[Result], env: dict, out_dir: Path) -> list[Path] | None:
    """Write the figures into ``out_dir``; return their paths, or None when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    paths = []
    for key, group in grouped(results).items():
        timed = [r for r in group if r.status == "ok" and r.ms]
        if not timed:
            continue
        fig = Figure(figsize=(13, 9) if key[0] != "decode" else (max(8, 5 * _n_batches(timed)), 8.5),
                     dpi=110)
        if key[0] == "decode":
            _draw_decode(fig, timed)
        else:
            _draw_dense(fig, timed)
        fig.suptitle(_title(key, timed, env), fontsize=13, fontweight="bold")
        fig.tight_layout(rect=(0, 0.07 if _legend(fig) else 0, 1, 0.95))
        mode, dtype, head_dim, causal, extra = key
        name = f"{mode}-{dtype}-d{head_dim}" + ("" if mode == "decode" else
                                                 "-causal" if causal else "-noncausal") + _slug(extra)
        path = Path(out_dir) / f"{name}.png"
        fig.savefig(path)
        paths.append(path)
    return paths


def _slug(extra: str) -> str:
    """A group's packed lengths and score variants for a file name: "varlen 14 seqs 512-4096, 32768
    tokens, softcap=30 sinks" -> "-varlen-14seqs-512-4096-32768tok-softcap30-sinks" ("" for none)."""
    if not extra:
        return ""
    text = extra.replace(" seqs", "seqs").replace(" tokens", "tok").replace("=", "")
    return "-" + "-".join(w for w in re.split(r"[^A-Za-z0-9.]+", text) if w)


def _n_batches(results) -> int:
    return len({r.workload.batch for r in results})


def _title(key, results, env) -> str:
    """Two lines: what was run, then the shape and the GPU."""
    wls = [r.workload for r in results]
    heads = ", ".join(sorted({f"H={w.heads}" if w.heads == w.heads_kv else f"Hq={w.heads}, Hkv={w.heads_kv}"
                              for w in wls}))
    tokens = {w.batch * w.seqlen_q for w in wls}
    if key[0] == "decode":
        shape = f"{heads}, one query token; paged caches use {PAGE_SIZE}-token pages"
    elif wls[0].seqlens is not None:
        shape = f"{len(wls[0].seqlens)} packed sequences, {heads}"
    elif len({w.seqlen_q for w in wls}) == 1:
        shape = f"B={wls[0].batch}, {heads}, S={wls[0].seqlen_q}"
    elif len({w.batch for w in wls}) == 1:
        shape = f"B={wls[0].batch}, {heads}"
    elif len(tokens) == 1:
        shape = f"B x S = {tokens.pop()} tokens, {heads}"
    else:
        shape = heads
    windows = {w.window for w in wls if w.window is not None}
    if windows:
        shape += ", window " + " / ".join(f"({left}, {right})" for left, right in sorted(windows))
    return f"triflash bench: {group_title(key)}\n{shape} | {env.get('gpu', '')}"


def _style(name: str) -> dict:
    return {"color": COLORS.get(name, "#333333"), "marker": MARKERS[_order(name) % len(MARKERS)],
            "linestyle": "--" if name.endswith("-paged") or name == "naive" else "-",
            "linewidth": 2.6 if name.startswith("triflash") else 1.6,
            "zorder": 3 if name.startswith("triflash") else 2}


def _by_provider(results) -> dict[str, list[Result]]:
    out: dict[str, list[Result]] = {}
    for r in sorted(results, key=lambda r: (_order(r.provider), r.workload.seqlen_k)):
        out.setdefault(r.provider, []).append(r)
    return out


def _order(name: str) -> int:
    return PROVIDER_ORDER.index(name) if name in PROVIDER_ORDER else len(PROVIDER_ORDER)


def _tokens_label(n: int) -> str:
    """1024 -> '1k', 131072 -> '128k', 512 -> '512'."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _log2_x(ax, values, label: str) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(values))
    ax.set_xticks(ticks)
    ax.set_xticklabels([_tokens_label(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel(label)


def _lines(ax, results, value, x_of, band=None) -> bool:
    """One line per provider, with p20-p80 error bars where ``band`` gives them; False when there
    was nothing to draw."""
    drew = False
    for name, rs in _by_provider(results).items():
        points = [(x_of(r), value(r), band(r) if band else None) for r in rs if value(r) is not None]
        if points:
            xs, ys, bands = zip(*points)
            ax.plot(xs, ys, label=name, markersize=6, **_style(name))
            if all(b is not None for b in bands):
                err = [[max(y - lo, 0) for y, (lo, _) in zip(ys, bands)],
                       [max(hi - y, 0) for y, (_, hi) in zip(ys, bands)]]
                ax.errorbar(xs, ys, yerr=err, fmt="none", ecolor=_style(name)["color"], elinewidth=1, capsize=3)
            drew = True
    return drew


def _bars(ax, results, value, band=None) -> bool:
    """One bar per provider, labelled with its value, with p20-p80 error bars where ``band`` gives
    them; False when there was nothing to draw."""
    rows = [(name, value(rs[0]), band(rs[0]) if band else None) for name, rs in _by_provider(results).items()
            if value(rs[0]) is not None]
    if not rows:
        return False
    names, values, bands = zip(*rows)
    err = None
    if all(b is not None for b in bands):
        err = [[max(v - lo, 0) for v, (lo, _) in zip(values, bands)],
               [max(hi - v, 0) for v, (_, hi) in zip(values, bands)]]
    bars = ax.bar(range(len(names)), values, color=[_style(n)["color"] for n in names],
                  edgecolor="black", linewidth=0.6, yerr=err, capsize=4 if err else 0)
    ax.bar_label(bars, fmt="%.3g", fontsize=8, padding=2)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.margins(y=0.15)
    return True


def _linear_from_zero(ax, values) -> None:
    """A linear axis from 0 with room above the highest value (a flat line at the top stays visible)."""
    ax.set_ylim(bottom=0, top=max(values) * 1.12 if values else None)


def _log_y(ax, values) -> None:
    """Log y axis with plain numbers (0.5, 1, 2, 5, ...) instead of 10^x labels, where the values span
    a factor of 4 or more (bars of naive attention 100x slower would flatten the rest on a linear
    axis); otherwise linear from 0, so that 64 against 66 MiB reads as nearly equal, not as 1 : 30."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    values = [v for v in values if v]
    if not values or max(values) < 4 * min(values):
        _linear_from_zero(ax, values)
        return
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _draw_dense(fig, results) -> None:
    """Only the panels with something to show (no empty "not measured" panel): 2x2, or 1xN."""
    single = len({r.workload.seqlen_q for r in results}) == 1
    panels = [p for p in DENSE_PANELS if any(p.value(r) is not None for r in results)]
    axes = fig.subplots(2, 2).flatten() if len(panels) == 4 else fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels):
        ax.set_title(panel.title)
        if single:
            _bars(ax, results, panel.value, panel.band)
        else:
            _lines(ax, results, panel.value, lambda r: r.workload.seqlen_q, panel.band)
            _log2_x(ax, [r.workload.seqlen_q for r in results], "sequence length S")
        values = [panel.value(r) for r in results if panel.value(r) is not None]
        if panel.log_y:
            _log_y(ax, values)
        else:
            _linear_from_zero(ax, values)
        if panel.baseline is not None:
            ax.axhline(panel.baseline, color="black", linewidth=0.8, linestyle=":")
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, axis="y" if single else "both", which="major", alpha=0.35)


def _draw_decode(fig, results) -> None:
    batches = sorted({r.workload.batch for r in results})
    axes = fig.subplots(len(DECODE_PANELS), len(batches), squeeze=False)
    for col, batch in enumerate(batches):
        rs = [r for r in results if r.workload.batch == batch]
        for row, panel in enumerate(DECODE_PANELS):
            ax = axes[row][col]
            ax.set_title(f"{panel.title}, B={batch}")
            _lines(ax, rs, panel.value, lambda r: r.workload.seqlen_k, panel.band)
            _log2_x(ax, [r.workload.seqlen_k for r in rs], "context length")
            values = [panel.value(r) for r in rs if panel.value(r) is not None]
            if panel.log_y:
                _log_y(ax, values)
            else:
                _linear_from_zero(ax, values)
            ax.set_ylabel(panel.ylabel)
            ax.grid(True, which="major", alpha=0.35)


def _legend(fig) -> bool:
    """One legend for the whole figure, providers in their fixed order (bar charts need none: their
    bars are labelled on the axis). Returns whether there is one."""
    handles = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    names = sorted(handles, key=_order)
    if names:
        fig.legend([handles[n] for n in names], names, loc="lower center", ncol=min(len(names), 8),
                   frameon=False, fontsize=10)
    return bool(names)
