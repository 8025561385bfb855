"""The tcpc benchmark: every model family at its real dims, decode and prefill, on the simulator.

    python benchmarks/run.py            # the full table (a few minutes on 2 cores)
    python benchmarks/run.py --quick    # a small subset; writes files only with --out
    python benchmarks/run.py --out DIR  # where results.md and phases.png go (default: benchmarks/)

For every model family (examples/*.moe at the dims of the model in each file's header) and
T in 1, 16, 64 (decode) and 2048, 4096 (prefill) it compiles the layer with the full lowering
pipeline and simulates it cost-only (routing `balanced`: no weights, no values; the only way at
real dims, where DeepSeek-V3's experts alone are 22 GB). The block size is
B = min(64, max(1, the next power of two >= ceil(T*K / E))): the rows an expert receives
under balanced routing, rounded up to a power of two and capped at 64.

One more run measures the budget: Qwen3-30B-A3B prefill, T = 4096, with real weights (random,
seeded), simulated with values; compile and simulate are timed separately.

Each row: simulated and roofline microseconds and their ratio, the simulated time split by
phase (cycles on the critical path, which sum to the total; runtime_sim/perf/report.py), peak
SRAM, the buffers streamed through HBM, and the wall-clock seconds of compiling and of
simulating. The table goes to stdout and to results.md; a stacked-bar chart of the phases to
phases.png (needs matplotlib: `pip install -e '.[bench]'`; without it the chart is skipped).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import tcpc  # noqa: E402
from dialects.annotations import PHASES  # noqa: E402
from runtime_sim.perf.cost_only import simulate_cost_only  # noqa: E402
from runtime_sim.perf.report import SimReport  # noqa: E402
from runtime_sim.perf.simulate import simulate  # noqa: E402

EXAMPLES = ROOT / "examples"
TOKENS: tuple[int, ...] = (1, 16, 64, 2048, 4096)
QUICK_TOKENS: tuple[int, ...] = (1, 64)


@dataclass(frozen=True)
class Model:
    name: str
    """The example file's stem."""
    title: str
    dims: dict[str, int]
    """The real model's dims (every dim but T and B)."""

    @property
    def path(self) -> Path:
        return EXAMPLES / f"{self.name}.moe"


MODELS: tuple[Model, ...] = (
    Model("mixtral", "Mixtral-8x7B", dict(D=4096, F=14336, E=8, K=2)),
    Model("qwen3_moe", "Qwen3-30B-A3B", dict(D=2048, F=768, E=128, K=8)),
    Model("deepseek_v3", "DeepSeek-V3", dict(D=7168, F=2048, FS=2048, E=256, K=8, NG=8, TG=4)),
    Model("gpt_oss", "gpt-oss-120b", dict(D=2880, F=2880, E=128, K=4)),
    Model("llama4", "Llama-4-Scout", dict(D=5120, F=8192, FS=8192, E=16, K=1)),
)
"""Dims from each example's header (Mixtral's: docs/models.md#configurations)."""

BUDGET_MODEL, BUDGET_TOKENS = "qwen3_moe", 4096


def block_size(tokens: int, k: int, experts: int) -> int:
    """B = min(64, max(1, next power of two >= ceil(T*K / E)))."""
    rows = -(-tokens * k // experts)
    return min(64, max(1, 1 << max(0, rows - 1).bit_length()))


@dataclass
class Row:
    model: str
    title: str
    tokens: int
    block: int
    mode: str
    """`cost-only` (balanced routing) or `values` (real weights, the router's own routing)."""
    total_cycles: int
    roofline_cycles: float
    microseconds: float
    roofline_microseconds: float
    critical: dict[str, int]
    """Phase -> cycles on the critical path (they sum to total_cycles)."""
    busy: dict[str, int]
    """Phase -> engine cycles, every engine and unit summed."""
    engine_busy: int
    peak_sram_bytes: int
    streams: int
    spills: int
    compile_seconds: float
    simulate_seconds: float
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.total_cycles / self.roofline_cycles if self.roofline_cycles else math.inf


def _row(model: Model, tokens: int, block: int, mode: str, report: SimReport,
         compile_seconds: float, simulate_seconds: float) -> Row:
    phases = report.phases
    return Row(model.name, model.title, tokens, block, mode, report.total_cycles, report.roofline.cycles,
               report.microseconds, report.machine.cycles_to_us(report.roofline.cycles),
               {p.name: p.critical_cycles for p in phases}, {p.name: p.busy_cycles for p in phases},
               sum(e.busy_cycles for e in report.engines), report.peak_sram_bytes, len(report.streams),
               len(report.spills), compile_seconds, simulate_seconds)


def dims_for(model: Model, tokens: int) -> dict[str, int]:
    return {**model.dims, "T": tokens, "B": block_size(tokens, model.dims["K"], model.dims["E"])}


def bench_row(model: Model, tokens: int, dims: dict[str, int] | None = None) -> Row:
    """Compile `model` at T = tokens (or at `dims`) and simulate it cost-only, routing balanced."""
    dims = dims or dims_for(model, tokens)
    start = time.perf_counter()
    program = tcpc.compile_file(model.path, dims=dims)
    name = program.function().sym_name.data
    module = program.lower("pin-routing," + program.full_pipeline())
    compiled = time.perf_counter()
    result = simulate_cost_only(module, name, routing="balanced")
    done = time.perf_counter()
    return _row(model, dims["T"], dims["B"], "cost-only", result.report, compiled - start, done - compiled)


def random_inputs(program: tcpc.Program, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs in the declared dtypes: activations ~ N(0, 1), weights ~ N(0, 1/fan_in)
    (fan_in the second-to-last axis), vectors ~ N(0, 1). Drawn in f32, a million at a time,
    which is several times faster than tcpc's own `draw` (f64) at these sizes."""
    from dialects.tensor_types import shape_of
    from runtime_sim.semantics.numerics import round_to, tensor_dtype
    from tcpc.arrays import arg_names

    fn = program.function()
    rng = np.random.default_rng(seed)
    chunk = np.empty(1 << 20, np.float32)  # reused: fresh pages are slow to map
    inputs = {}
    for i, (name, t) in enumerate(zip(arg_names(fn), fn.function_type.inputs.data)):
        shape = shape_of(t)
        scale = np.float32(1.0 if i == 0 or len(shape) < 2 else 1.0 / math.sqrt(shape[-2]))
        want = tensor_dtype(t)
        out = np.empty(shape, want)
        flat = out.reshape(-1)
        for start in range(0, flat.size, chunk.size):
            part = chunk[:min(chunk.size, flat.size - start)]
            rng.standard_normal(out=part, dtype=np.float32)
            part *= scale
            flat[start:start + part.size] = round_to(part, want)
        inputs[name] = out
    return inputs


def budget_row(model: Model, tokens: int, seed: int = 0, dims: dict[str, int] | None = None) -> Row:
    """The layer with real (random, seeded) weights, simulated with values; compile and
    simulate timed separately (inputs are drawn before the clock starts, timed apart)."""
    from xdsl.interpreter import Interpreter

    dims = dims or dims_for(model, tokens)
    start = time.perf_counter()
    program = tcpc.compile_file(model.path, dims=dims)
    name = program.function().sym_name.data
    module = program.lower()
    compiled = time.perf_counter()
    inputs = random_inputs(program, seed)
    drawn = time.perf_counter()
    args = [inputs[n] for n in inputs]

    class Clock(Interpreter.Listener):
        """Wall-clock seconds of each op's numpy semantics, by op name."""

        def __init__(self) -> None:
            self.seconds: dict[str, float] = {}
            self._start = 0.0

        def will_interpret_op(self, op, args) -> None:  # type: ignore[no-untyped-def]
            self._start = time.perf_counter()

        def did_interpret_op(self, op, results) -> None:  # type: ignore[no-untyped-def]
            self.seconds[op.name] = self.seconds.get(op.name, 0.0) + time.perf_counter() - self._start

    clock = Clock()
    sim_start = time.perf_counter()
    result = simulate(module, name, args, listeners=[clock])
    done = time.perf_counter()
    row = _row(model, dims["T"], dims["B"], "values", result.report, compiled - start, done - sim_start)
    row.extra = {"inputs_seconds": drawn - compiled, "peak_rss_gb": _peak_rss_gb(),
                 **{f"op {k}": v for k, v in sorted(clock.seconds.items(), key=lambda kv: -kv[1])}}
    return row


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: kilobytes


# --- output ----------------------------------------------------------------------------------------


def _us(cycles: float, row: Row) -> str:
    return _num(cycles * row.microseconds / row.total_cycles) if row.total_cycles else "0"


def _num(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def table(rows: Sequence[Row]) -> str:
    """A markdown table: one row per run; phase columns are microseconds on the critical path."""
    phases = [p for p in PHASES if any(p in r.critical for r in rows)]
    head = (["model", "T", "B", "mode", "simulated µs", "roofline µs", "ratio"]
            + [f"{p} µs" for p in phases] + ["peak SRAM MB", "streams", "compile s", "simulate s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i < 4 else "---:" for i in range(len(head))) + "|"]
    for r in rows:
        cells = [r.title, str(r.tokens), str(r.block), r.mode, _num(r.microseconds), _num(r.roofline_microseconds),
                 f"{r.ratio:.2f}"]
        cells += [_us(r.critical.get(p, 0), r) for p in phases]
        cells += [f"{r.peak_sram_bytes / 2**20:.1f}", str(r.streams), f"{r.compile_seconds:.2f}", f"{r.simulate_seconds:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def budget_text(row: Row) -> str:
    ops = [(k[3:], v) for k, v in row.extra.items() if k.startswith("op ")]
    numpy_total = sum(v for _, v in ops)
    top = ", ".join(f"{name} {sec:.1f} s" for name, sec in ops[:5])
    total = row.compile_seconds + row.simulate_seconds
    stage = "prefill" if row.tokens >= 2048 else "decode"
    return (f"{row.title} {stage} T = {row.tokens}, B = {row.block}, real (random, seeded) weights, "
            f"simulated with values: compile {row.compile_seconds:.2f} s + simulate {row.simulate_seconds:.1f} s "
            f"= {total:.1f} s ({'within' if total < 60 else 'over'} the 60 s budget); drawing the inputs "
            f"took {row.extra.get('inputs_seconds', 0):.1f} s more, and the process peaked at "
            f"{row.extra.get('peak_rss_gb', 0):.1f} GB. Of the simulation, {numpy_total:.1f} s is spent running the "
            f"ops, their numpy semantics and cost functions ({top}); the rest is the interpreter, the memory "
            "plan and the scheduler. "
            f"Simulated {row.microseconds:,.0f} µs ({row.total_cycles:,} cycles), roofline "
            f"{row.roofline_microseconds:,.0f} µs.\n")


def machine_text(command: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        memory = f"{mem:.0f} GB RAM"
    except (ValueError, OSError, AttributeError):
        memory = "RAM unknown"
    return (f"Command: `{command}`. Machine: {cpu}, {os.cpu_count()} cores, {memory}; Python "
            f"{platform.python_version()}, numpy {np.__version__}.")


def chart(rows: Sequence[Row], path: Path) -> str:
    """A stacked-bar chart of each run's simulated time by phase (share of the critical
    path), one panel per model; returns what was done."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart skipped: matplotlib is not installed (pip install -e '.[bench]')"
    cost_only = [r for r in rows if r.mode == "cost-only"]
    models = list(dict.fromkeys(r.title for r in cost_only))
    phases = [p for p in PHASES if any(p in r.critical for r in cost_only)]
    colours = dict(zip(PHASES, ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#bab0ac"]))
    fig, axes = plt.subplots(1, len(models), figsize=(3.2 * len(models), 4.2), sharey=True, squeeze=False)
    for ax, title in zip(axes[0], models):
        mine = [r for r in cost_only if r.title == title]
        x = np.arange(len(mine))
        bottom = np.zeros(len(mine))
        for p in phases:
            share = np.array([100 * r.critical.get(p, 0) / r.total_cycles for r in mine])
            ax.bar(x, share, bottom=bottom, color=colours.get(p), label=p, width=0.7)
            bottom += share
        for xi, r in zip(x, mine):
            label = f"{r.microseconds / 1000:.1f} ms" if r.microseconds >= 1000 else f"{r.microseconds:.0f} µs"
            ax.text(xi, 101, label, ha="center", va="bottom", fontsize=7, rotation=90)
        ax.set_xticks(x, [str(r.tokens) for r in mine])
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("tokens T")
        ax.set_ylim(0, 125)
    axes[0][0].set_ylabel("% of simulated time (critical path)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(phases), fontsize=8, frameon=False)
    fig.suptitle("Simulated MoE layer time by phase on the whole RNGD chip (cost-only, balanced routing; "
                 "total time above each bar)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"chart written to {path}"


def results_markdown(rows: Sequence[Row], budget: Row | None, command: str) -> str:
    parts = ["# tcpc benchmark results", "",
             "Generated by `benchmarks/run.py` (see its docstring and benchmarks/README.md). "
             + machine_text(command), "",
             "Simulated on the default machine (`target/machines/rngd.toml`, the whole RNGD chip: 2 clusters of 256 "
             "slices at 1 GHz). Cost-only rows use balanced routing; the `values` row is the budget run, "
             "with real (random, seeded) weights and the router's own routing. Phase columns are the "
             "microseconds each phase spends on the critical path (they add up to the simulated time).", "",
             table([*rows, *([budget] if budget else [])])]
    if budget is not None:
        parts += ["## Budget", "", budget_text(budget)]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"T in {', '.join(map(str, QUICK_TOKENS))} only, and the budget run at T = 64")
    parser.add_argument("--out", type=Path, default=None,
                        help="where results.md and phases.png go (default: benchmarks/, or nowhere with --quick)")
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else (None if args.quick else Path(__file__).resolve().parent)
    tokens = QUICK_TOKENS if args.quick else TOKENS
    command = "python benchmarks/run.py" + (" --quick" if args.quick else "")

    rows: list[Row] = []
    for model in MODELS:
        for t in tokens:
            row = bench_row(model, t)
            rows.append(row)
            print(f"  {model.title} T={t}: {row.microseconds:,.1f} us, {row.ratio:.2f}x the roofline "
                  f"(compile {row.compile_seconds:.2f} s, simulate {row.simulate_seconds:.2f} s)", file=sys.stderr, flush=True)
    budget_model = next(m for m in MODELS if m.name == BUDGET_MODEL)
    budget_tokens = 64 if args.quick else BUDGET_TOKENS
    print(f"  budget: {budget_model.title} T={budget_tokens} with values ...", file=sys.stderr, flush=True)
    budget = budget_row(budget_model, budget_tokens)

    text = results_markdown(rows, budget, command)
    print(text)
    if out is None:
        print("(--quick: no files written; give --out DIR to keep them)")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text, encoding="utf-8")
    print(f"table written to {out / 'results.md'}")
    print(chart(rows, out / "phases.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
