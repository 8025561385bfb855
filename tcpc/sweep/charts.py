"""Sweep charts: the roofline and cycles against each swept parameter (matplotlib)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tcpc.sweep.spec import EXTRA, SweepError



INPUT_PREFIXES = ("dim.", "machine.", "pass.")
INPUT_COLUMNS = ("program", "routing", "seed", "sram_policy", "machine")


def swept_parameters(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """The input columns that take more than one value among `rows`."""
    rows = list(rows)
    names = list(INPUT_COLUMNS) + sorted({k for r in rows for k in r if k.startswith(INPUT_PREFIXES)})
    return [n for n in names if len({json.dumps(r.get(n)) for r in rows}) > 1]


def _label(row: Mapping[str, Any], names: Sequence[str]) -> str:
    """`T=64, sram.bytes_per_slice=128 KB`: the dim. and machine. prefixes left out."""
    return ", ".join(f"{n.removeprefix('dim.').removeprefix('machine.')}={_tick(n, row.get(n))}" for n in names) or "all"


def plot(rows: Sequence[Mapping[str, Any]], out: Path) -> list[Path]:
    """roofline.png (arithmetic intensity vs achieved FLOP/s under each machine's roof) and
    cycles_vs_PARAM.png for each swept parameter; the points that succeeded only."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SweepError(f"tcpc sweep --plot draws with matplotlib: {EXTRA}") from None
    ok = [r for r in rows if r.get("status") == "ok" and r.get("total_cycles")]
    if not ok:
        raise SweepError("nothing to plot: no point succeeded")
    swept = swept_parameters(ok)
    paths = [_roofline_chart(plt, ok, swept, out / "roofline.png")]
    for name in swept:
        paths.append(_cycles_chart(plt, ok, name, [s for s in swept if s != name],
                                   out / f"cycles_vs_{name.replace('.', '_')}.png"))
    return paths


def _roofline_chart(plt: Any, rows: Sequence[Mapping[str, Any]], swept: Sequence[str], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7.5, 5))
    points = [r for r in rows if r.get("arithmetic_intensity") and r.get("achieved_flops_per_s")]
    xs = [r["arithmetic_intensity"] for r in points]
    lo, hi = (min(xs) / 4, max(xs) * 4) if xs else (0.1, 1e4)
    roofs = sorted({(r["peak_flops_per_s"], r["hbm_bytes_per_s"]) for r in rows})
    for peak, bandwidth in roofs:
        knee = peak / bandwidth
        grid = sorted({lo, hi, min(max(knee, lo), hi)})
        label = f"roof: {peak / 1e12:.0f} TFLOP/s, {bandwidth / 1e12:.2f} TB/s" if len(roofs) > 1 else \
            f"roof: {peak / 1e12:.0f} TFLOP/s peak, {bandwidth / 1e12:.2f} TB/s HBM"
        ax.plot(grid, [min(peak, x * bandwidth) for x in grid], "k-" if len(roofs) == 1 else "-", lw=1.5, label=label)
    colour_by = swept[0] if swept else None
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in points:
        groups.setdefault(_label(r, [colour_by]) if colour_by else "points", []).append(r)
    for name, group in groups.items():
        ax.scatter([r["arithmetic_intensity"] for r in group], [r["achieved_flops_per_s"] for r in group],
                   s=28, label=name, zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per HBM byte)")
    ax.set_ylabel("achieved FLOP/s (layer FLOPs / simulated time)")
    ax.set_title("Roofline: simulated MoE layers")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _sort_key(value: Any) -> tuple[int, Any]:
    return (0, value) if isinstance(value, (int, float)) else (1, str(value))


def _tick(name: str, value: Any) -> str:
    if "bytes" in name and isinstance(value, int):
        for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
            if value >= scale and value % scale == 0:
                return f"{value // scale} {unit}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _cycles_chart(plt: Any, rows: Sequence[Mapping[str, Any]], name: str, others: Sequence[str], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(10 if others else 7.5, 5))
    values = sorted({r.get(name) for r in rows}, key=_sort_key)
    numeric = all(isinstance(v, (int, float)) for v in values)
    position = {v: (v if numeric else i) for i, v in enumerate(values)}
    lines: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        lines.setdefault(_label(r, others), []).append(r)
    for label, group in list(lines.items())[:12]:
        group = sorted(group, key=lambda r: _sort_key(r.get(name)))
        ax.plot([position[r.get(name)] for r in group], [r["total_cycles"] for r in group], "o-", ms=4, label=label)
    if len(lines) > 12:
        ax.set_title(f"{len(lines) - 12} more combinations not drawn", fontsize=8, loc="right")
    if numeric and len(values) > 2 and min(values) > 0 and max(values) / min(values) >= 4:
        ax.set_xscale("log", base=2)
    if not numeric or len(values) <= 10:
        ticks = [position[v] for v in values]
        ax.set_xticks(ticks, [_tick(name, v) for v in values])
        ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel(name)
    ax.set_ylabel("total cycles")
    ax.set_title(f"Cycles against {name}", loc="left")
    ax.grid(True, which="both", alpha=0.3)
    if len(lines) > 1:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
