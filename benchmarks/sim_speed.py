"""How fast the simulator runs at real dims, now that the schedule level runs loops op by op.

    python benchmarks/sim_speed.py                  # every family at T = 4096 cost-only, Qwen3 with values
    python benchmarks/sim_speed.py --tokens 2048    # other token counts
    python benchmarks/sim_speed.py --values-tokens 0  # cost-only rows only
    python benchmarks/sim_speed.py --schedule --out benchmarks   # schedule.md's rows, timed: benchmarks/schedule_speed.md
    python benchmarks/sim_speed.py --schedule --families deepseek_v3 --tokens 4096   # some of them
    python benchmarks/sim_speed.py --sweep          # tcpc sweep examples/sweeps/blocks.toml: points per second

Rows:
- `cost-only`: every family of benchmarks/run.py at its real dims and T, block size by
  run.py's rule, compiled with the full pipeline and simulated without values (balanced routing);
- `values`: Qwen3-30B-A3B with real (random, seeded) bf16 weights, simulated with values and the
  router's own routing (the budget run of benchmarks/run.py); drawing the inputs is timed apart.
  Its contractions run one single-threaded BLAS call per grid tile (numerics.one_blas_thread:
  the bits do not depend on the core count), so its CPU and wall seconds are close on an idle
  machine;
- `transformers f32`: when torch and transformers are installed (optional, never a dependency
  of tcpc: `pip install -e '.[bench-hf]'`), HuggingFace's own `Qwen3MoeSparseMoeBlock` with
  the same dims, forward on the same number of tokens in f32 on the CPU, for comparison with the
  `values` row (random weights: the time does not depend on them). Skipped otherwise.

Columns: ops simulated (the commands the report lists: every op instance the interpreter ran,
each loop iteration's ops once per iteration, plus the memory plan's own commands), wall seconds
of the simulation (interpretation, costing, memory plan, scheduling and report; compiling and
drawing inputs excluded), and CPU seconds of this process over the same span (torch's threads
add up in the `transformers` row; on a machine shared with other jobs the CPU column is the
steadier one; docs/simulator.md's table is one such run).

`--schedule` times the rows of benchmarks/schedule.md instead (every family, T = 1, 16, 64,
2048, 4096 unless told), each as schedule.py makes it (`schedule_row`: compile with block=auto,
the cost model's strategy and loop order, the cost-only run and the row's summaries), each in a
process of its own: its wall and CPU seconds, the process's peak resident memory, the cost-only
simulations it ran (the candidates of every choice; the row's own run is the cheapest
candidate's, not run again, when the strategy and order choices kept it; a block candidate
bounded before interleave-shared and then simulated in full counts twice), and the seconds by
stage: compiling (every apply_pipeline), interpreting (recording the trace), planning memory
and scheduling, the report, and the rest (parsing, building, summaries). The stages are
timed by wrapping those functions in the child process (exclusive times, no profiler
overhead). A row above TARGET_SECONDS wall says where its time goes from those columns.

`--sweep` runs `tcpc sweep` on SWEEP_SPEC (every point a compile with the cost model's choices
and a cost-only run) on a LocalCluster of `--workers` processes, into a fresh directory, and
prints its points per second as `tcpc sweep` does (wall, from handing the points to the cluster
to the last result), the CPU seconds of every point (each point's process time, summed: what
the points cost, whatever the machine's other jobs), and the points per CPU second.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import tcpc  # noqa: E402
from runtime_sim.perf.cost_only import simulate_cost_only  # noqa: E402
from runtime_sim.perf.simulate import simulate  # noqa: E402


if str(ROOT / "benchmarks") not in sys.path:  # run.py, the model table, next to this script
    sys.path.insert(0, str(ROOT / "benchmarks"))

import run as bench  # noqa: E402

TOKENS: tuple[int, ...] = (4096,)
VALUES_MODEL = "qwen3_moe"


@dataclass
class Row:
    title: str
    tokens: int
    block: int | None
    mode: str
    ops: int | None
    """Commands simulated; None for the transformers row."""
    wall_seconds: float
    cpu_seconds: float
    note: str = ""


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def cost_only_row(model, tokens: int, dims: dict[str, int] | None = None) -> Row:  # type: ignore[no-untyped-def]
    """Compile `model` at T = tokens and simulate it cost-only (routing balanced), timed."""
    dims = dims or bench.dims_for(model, tokens)
    program = tcpc.compile_file(model.path, dims=dims)
    name = program.function().sym_name.data
    module = program.lower("pin-routing," + program.full_pipeline())
    wall, cpu = _clocks()
    result = simulate_cost_only(module, name, routing="balanced")
    text = result.report.to_text()  # the report, as `tcpc run --report` prints it
    wall_end, cpu_end = _clocks()
    return Row(model.title, tokens, dims.get("B"), "cost-only", len(result.report.ops), wall_end - wall,
               cpu_end - cpu, f"{result.report.total_cycles:,} cycles, report {len(text) // 1024:,} KB")


def values_row(model, tokens: int, seed: int = 0, dims: dict[str, int] | None = None) -> Row:  # type: ignore[no-untyped-def]
    """Compile `model` at T = tokens and simulate it with seeded random inputs, timed apart
    from drawing the inputs."""
    dims = dims or bench.dims_for(model, tokens)
    program = tcpc.compile_file(model.path, dims=dims)
    name = program.function().sym_name.data
    module = program.lower()
    drawn, _ = _clocks()
    inputs = bench.random_inputs(program, seed)
    wall, cpu = _clocks()
    result = simulate(module, name, list(inputs.values()))
    text = result.report.to_text()
    wall_end, cpu_end = _clocks()
    return Row(model.title, tokens, dims.get("B"), "values", len(result.report.ops), wall_end - wall,
               cpu_end - cpu, f"{result.report.total_cycles:,} cycles, report {len(text) // 1024:,} KB; "
               f"drawing the inputs {wall - drawn:.1f} s more")


def transformers_row(model, tokens: int, repeats: int = 3) -> Row | None:  # type: ignore[no-untyped-def]
    """HuggingFace's Qwen3-MoE block at `model`'s dims, forward on `tokens` tokens in f32 on
    the CPU: the best of `repeats` runs after one warm-up. None without torch and transformers."""
    try:
        import torch
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except ImportError:
        return None
    d = model.dims
    config = Qwen3MoeConfig(hidden_size=d["D"], moe_intermediate_size=d["F"], num_experts=d["E"],
                            num_experts_per_tok=d["K"], norm_topk_prob=True)
    torch.manual_seed(0)
    with torch.no_grad():
        block = Qwen3MoeSparseMoeBlock(config).float().eval()
        x = torch.randn(1, tokens, d["D"], dtype=torch.float32)
        block(x)
        best_wall, best_cpu = float("inf"), float("inf")
        for _ in range(repeats):
            wall, cpu = _clocks()
            block(x)
            wall_end, cpu_end = _clocks()
            best_wall, best_cpu = min(best_wall, wall_end - wall), min(best_cpu, cpu_end - cpu)
    return Row(model.title, tokens, None, "transformers f32", None, best_wall, best_cpu,
               f"torch {torch.__version__}, {torch.get_num_threads()} threads; best of {repeats}")


TARGET_SECONDS = 2.0
"""Issue #32's target for a row of benchmarks/schedule.md: wall seconds, compile and choices included."""
SCHEDULE_TOKENS: tuple[int, ...] = (1, 16, 64, 2048, 4096)
STAGES: tuple[str, ...] = ("compile", "interpret", "plan+schedule", "report", "other")


@dataclass
class ScheduleSpeed:
    """One row of benchmarks/schedule.md, timed (`--schedule`)."""

    title: str
    tokens: int
    block: int
    cycles: int
    wall_seconds: float
    cpu_seconds: float
    peak_rss_mb: float
    simulations: int
    """Cost-only runs recorded: every candidate of every choice (and the row's own, when the
    choices did not keep it; a candidate bounded before interleave-shared, tcpc/autotune.py's
    `bound_first`, and then simulated, twice)."""
    stages: dict[str, float] = field(default_factory=dict)
    """Stage -> CPU seconds spent in it and not in a stage nested in it (STAGES)."""


class _StageClock:
    """Exclusive CPU seconds per stage, by wrapping the functions that are the stages (put
    back when the clock is closed)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.calls = dict.fromkeys(STAGES, 0)
        self._stack: list[list[Any]] = []
        self._wrapped: list[tuple[Any, str, Any]] = []

    def wrap(self, module: Any, name: str, stage: str) -> None:
        fn: Callable[..., Any] = getattr(module, name)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [stage, time.process_time(), 0.0]  # stage, start, seconds in nested stages
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = time.process_time() - frame[1]
                self.seconds[stage] += spent - frame[2]
                self.calls[stage] += 1
                if self._stack:
                    self._stack[-1][2] += spent

        self._wrapped.append((module, name, fn))
        setattr(module, name, timed)

    def close(self) -> None:
        for module, name, fn in reversed(self._wrapped):
            setattr(module, name, fn)
        self._wrapped.clear()


def schedule_speed(model, tokens: int) -> ScheduleSpeed:  # type: ignore[no-untyped-def]
    """benchmarks/schedule.py's row of `model` at T = tokens (block=auto), timed; run it in a
    process of its own (`--schedule` does), whose peak memory is then the row's."""
    import schedule

    import tcpc.autotune
    import tcpc.program
    from runtime_sim.perf import cost_only, simulate

    clock = _StageClock()
    try:
        for module in (tcpc.autotune, tcpc.program):
            clock.wrap(module, "apply_pipeline", "compile")
        clock.wrap(cost_only, "_record", "interpret")
        clock.wrap(cost_only, "plan_and_schedule", "plan+schedule")  # the candidates' (no report)
        clock.wrap(simulate, "plan_and_schedule", "plan+schedule")  # the row's own, inside simulate_trace
        clock.wrap(cost_only, "simulate_trace", "report")
        clock.wrap(cost_only, "trace_report", "report")  # the report of a run the choices kept
        wall, cpu = _clocks()
        row = schedule.schedule_row(model, tokens)
        wall_end, cpu_end = _clocks()
    finally:
        clock.close()
    clock.seconds["other"] = (cpu_end - cpu) - sum(clock.seconds.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    return ScheduleSpeed(row.title, tokens, row.block, row.cycles, wall_end - wall, cpu_end - cpu, peak,
                         clock.calls["interpret"], clock.seconds)


def schedule_table(rows: Sequence[ScheduleSpeed]) -> str:
    head = ["model", "T", "B", "simulated cycles", "run s", "CPU s", "peak RSS MB", "simulations",
            *(f"{s} s" for s in STAGES)]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        cells = [r.title, str(r.tokens), str(r.block), f"{r.cycles:,}", f"{r.wall_seconds:.2f}", f"{r.cpu_seconds:.2f}",
                 f"{r.peak_rss_mb:.0f}", str(r.simulations), *(f"{r.stages[s]:.2f}" for s in STAGES)]
        lines.append("| " + " | ".join(cells) + " |")
    over = [r for r in rows if r.wall_seconds > TARGET_SECONDS]
    lines.append("")
    lines.append(f"{len(rows) - len(over)} of {len(rows)} rows within {TARGET_SECONDS:g} s wall; the largest peak "
                 f"RSS {max((r.peak_rss_mb for r in rows), default=0):.0f} MB.")
    for r in over:
        top = max(STAGES, key=lambda s: r.stages[s])
        lines.append(f"- {r.title} T={r.tokens}: {r.wall_seconds:.1f} s wall, {r.simulations} simulations; "
                     f"most in {top} ({r.stages[top]:.1f} of {r.cpu_seconds:.1f} CPU s)")
    return "\n".join(lines) + "\n"


SWEEP_SPEC = ROOT / "examples" / "sweeps" / "blocks.toml"


def _timed_point(point: Any) -> tuple[dict[str, Any], float]:
    """`run_point` and the CPU seconds it took (in the worker that ran it)."""
    from tcpc.sweep import run_point

    cpu = time.process_time()
    row = run_point(point)
    return row, time.process_time() - cpu


def sweep_speed(spec_path: Path, workers: int) -> str:
    """`tcpc sweep`'s rate on `spec_path` (run_sweep on a LocalCluster of `workers` processes,
    into a fresh directory), and the CPU seconds of its points, run again one by one on the
    same cluster with each point's process time."""
    import tempfile

    from dask.distributed import Client, LocalCluster

    from tcpc.sweep import load_spec, run_sweep

    spec = load_spec(spec_path)
    with tempfile.TemporaryDirectory(prefix="sim-speed-sweep-") as tmp:
        outcome = run_sweep(spec, Path(tmp) / "out", workers=workers)
    with LocalCluster(n_workers=workers, threads_per_worker=1, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        timed = client.gather(client.map(_timed_point, spec.points, pure=False))
    cpu = sum(seconds for _, seconds in timed)
    ok = sum(row["status"] == "ok" for row, _ in timed)
    return (f"tcpc sweep {spec_path.relative_to(ROOT)}: {outcome.points_per_second:.2f} points per second "
            f"({outcome.ran} in {outcome.seconds:.1f} s wall on {workers} worker processes, {len(outcome.failed)} "
            f"failed); the points again, one process time each: {cpu:.1f} CPU s for {len(timed)} ({ok} ok), "
            f"{len(timed) / cpu:.2f} points per CPU second\n")


def table(rows: Sequence[Row]) -> str:
    head = ["family", "T", "B", "mode", "ops simulated", "wall s", "CPU s", "note"]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---:|---|---:|---:|---:|---|"]
    for r in rows:
        cells = [r.title, str(r.tokens), "-" if r.block is None else str(r.block), r.mode,
                 "-" if r.ops is None else f"{r.ops:,}", f"{r.wall_seconds:.2f}", f"{r.cpu_seconds:.2f}", r.note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help=f"T of the cost-only rows (default {' '.join(map(str, TOKENS))})")
    parser.add_argument("--values-tokens", type=int, default=4096,
                        help="T of the Qwen3-30B-A3B run with values (and of transformers'); 0: none")
    parser.add_argument("--families", nargs="+", default=[m.name for m in bench.MODELS],
                        help="families of the cost-only rows (example names)")
    parser.add_argument("--schedule", action="store_true",
                        help="time benchmarks/schedule.md's rows instead (T = 1 16 64 2048 4096 unless --tokens)")
    parser.add_argument("--out", type=Path, default=None, help="with --schedule, also write DIR/schedule_speed.md")
    parser.add_argument("--sweep", action="store_true",
                        help=f"time tcpc sweep on {SWEEP_SPEC.relative_to(ROOT)} instead: points per second")
    parser.add_argument("--workers", type=int, default=2, help="with --sweep: LocalCluster worker processes")
    args = parser.parse_args(argv)
    if args.sweep:
        print(sweep_speed(SWEEP_SPEC, args.workers))
        return 0
    models = {m.name: m for m in bench.MODELS}
    unknown = [f for f in args.families if f not in models]
    if unknown:
        parser.error(f"unknown famil{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)} "
                     f"(families: {', '.join(models)})")
    if args.schedule:
        tokens = SCHEDULE_TOKENS if args.tokens is None else args.tokens
        speeds = []
        context = multiprocessing.get_context("spawn")  # a fresh process per row: its peak memory is the row's
        for name in args.families:
            for t in tokens:
                with context.Pool(1) as pool:
                    speeds.append(pool.apply(schedule_speed, (models[name], t)))
                r = speeds[-1]
                print(f"  {r.title} T={t} B={r.block}: {r.wall_seconds:.1f} s wall, {r.cpu_seconds:.1f} CPU s, "
                      f"{r.peak_rss_mb:.0f} MB", file=sys.stderr, flush=True)
        text = schedule_table(speeds)
        print(text)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            command = "python benchmarks/sim_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])
            about = (__doc__ or "").split("`--schedule` times", 1)[1].split("`--sweep` runs", 1)[0].strip()
            (args.out / "schedule_speed.md").write_text(
                f"# How fast benchmarks/schedule.md's rows run\n\nGenerated by `{command.strip()}`. "
                + bench.machine_text(command.strip()) + "\n\n`--schedule` times " + about + "\n\n" + text,
                encoding="utf-8")
        return 0
    rows: list[Row] = []
    for name in args.families:
        for t in args.tokens or TOKENS:
            print(f"  {name} T={t} cost-only ...", file=sys.stderr, flush=True)
            rows.append(cost_only_row(models[name], t))
    if args.values_tokens:
        model = models[VALUES_MODEL]
        print(f"  {model.title} T={args.values_tokens} with values ...", file=sys.stderr, flush=True)
        rows.append(values_row(model, args.values_tokens))
        hf = transformers_row(model, args.values_tokens)
        if hf is None:
            print("  (torch or transformers not installed: no transformers row)", file=sys.stderr)
        else:
            rows.append(hf)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
