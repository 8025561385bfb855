"""Strategies side by side (docs/architecture.md#strategies), on the same simulator.

    python benchmarks/strategies.py            # Mixtral-8x7B and Qwen3-30B-A3B, T = 1, 64, 2048
    python benchmarks/strategies.py --quick    # T = 1 and 64 only; writes files only with --out
    python benchmarks/strategies.py --out DIR  # where strategies.md goes (default: benchmarks/)

Every run is cost-only with balanced routing, at the model's real dims, on the default machine.
The strategies:

- `blockwise`: the default pipeline, with the benchmark's block rule (benchmarks/run.py:
  B = min(64, max(1, next power of two >= ceil(T*K / E)))).
- `padded`: the same pipeline with B = T. Then every expert gets one block of T rows (G = E
  blocks when T*K >= E, dialects.moe.max_blocks): exactly the padded-scatter plan's [E, T, D]
  buffer; the guards still skip empty experts.
- `dense`: every expert computes every token, masked by the routing weight. Written in the .moe
  language itself (`dense_source`): the scatter / grouped_matmul / combine lines of the example
  become batched matmuls of x [T, 1, 1, D] by the [E, D, F] weights (-> [T, E, 1, F]), a dense
  weight matrix [T, E] from one_hot(top_e, E) and the top-k weights, and a sum over E.
- `topk rounds`: blockwise with `lower-topk{strategy=rounds}` (K rounds of reduce-max) in place
  of the all-pairs ranking.

Every strategy goes through the same full pipeline, `load-arguments` and the schedule level
included (what `tcpc run` simulates: the expert loop over blocks, token tiles, fused vector
chains): an argument a contraction or vector op reads (the router, x, the dense strategy's
whole weight tensors) is loaded by a `tcp.load`, so the dense strategy pays for fetching every
expert's weights (a load too large for SRAM is delivered into its readers' tiles, see
runtime_sim/perf/memory_plan.py). The dense strategy has no grouped matmul, so the expert loop
does not apply to it; its vector work is tiled over tokens like the others'.

Columns: simulated and roofline microseconds and their ratio, peak SRAM, and the layer's HBM
bytes (the roofline's: the commands as traced, without the memory plan's spills and streams).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))


import tcpc  # noqa: E402
from runtime_sim.perf.cost_only import simulate_cost_only  # noqa: E402
from tcpc.pipelines import FULL_PIPELINE  # noqa: E402


if str(ROOT / "benchmarks") not in sys.path:  # run.py, the model table, next to this script
    sys.path.insert(0, str(ROOT / "benchmarks"))

import run as bench  # noqa: E402

MODELS = tuple(m for m in bench.MODELS if m.name in ("mixtral", "qwen3_moe"))
TOKENS: tuple[int, ...] = (1, 64, 2048)
QUICK_TOKENS: tuple[int, ...] = (1, 64)
STRATEGIES: tuple[str, ...] = ("blockwise", "padded", "dense", "topk rounds")


def dense_source(source: str) -> str:
    """The example's program with dense dispatch: its `scatter` line through its `return
    combine(...)` line replaced by every expert computing every token, weighted by the dense
    routing weights (zero for the experts a token did not pick). For the SwiGLU examples
    (w_gate, w_up, w_down)."""
    lines = source.splitlines()
    first = next(i for i, line in enumerate(lines) if "scatter(" in line)
    last = next(i for i, line in enumerate(lines) if line.strip().startswith("return combine("))
    match = re.search(r"route, (.*)\)\s*$", lines[last].strip())
    assert match is not None, "the combine line names the routing weights last"
    weights = match.group(1)
    lines[first:last + 1] = [
        "    xd = reshape(x, [T, 1, 1, D])",
        "    hd = silu(xd @ w_gate) * (xd @ w_up)                       # [T, E, 1, F]",
        "    yd = hd @ w_down                                          # [T, E, 1, D]",
        f"    wd = sum(f32(one_hot(top_e, E)) * f32(reshape({weights}, [T, K, 1])), axis=1)   # [T, E]",
        "    return bf16(reshape(sum(yd * reshape(wd, [T, E, 1, 1]), axis=1), [T, D]))",
    ]
    return "\n".join(lines) + "\n"


@dataclass
class Row:
    title: str
    tokens: int
    strategy: str
    block: int | None
    total_cycles: int
    microseconds: float
    roofline_microseconds: float
    roofline_cycles: float
    peak_sram_bytes: int
    hbm_bytes: int
    simulate_seconds: float

    @property
    def ratio(self) -> float:
        return self.total_cycles / self.roofline_cycles


def strategy_row(model, tokens: int, strategy: str, dims: dict[str, int] | None = None) -> Row:  # type: ignore[no-untyped-def]
    """Compile `model` at T = tokens (or at `dims`, whose B is replaced per strategy) with
    `strategy` and simulate it cost-only, routing balanced."""
    dims = dict(dims or bench.dims_for(model, tokens))
    tokens = dims["T"]
    if strategy == "padded":
        dims["B"] = tokens
    source = model.path.read_text()
    if strategy == "dense":
        source = dense_source(source)
    start = time.perf_counter()
    program = tcpc.compile_source(source, dims=dims, filename=str(model.path))
    name = program.function().sym_name.data
    passes = list(FULL_PIPELINE)
    if strategy == "topk rounds":
        passes[passes.index("lower-topk")] = "lower-topk{strategy=rounds}"
    module = program.lower(",".join(["pin-routing", *passes]))
    report = simulate_cost_only(module, name, routing="balanced").report
    seconds = time.perf_counter() - start
    m = report.machine
    return Row(model.title, tokens, strategy, None if strategy == "dense" else dims["B"], report.total_cycles,
               report.microseconds, m.cycles_to_us(report.roofline.cycles), report.roofline.cycles,
               report.peak_sram_bytes, report.roofline.hbm_bytes, seconds)


def table(rows: Sequence[Row]) -> str:
    head = ["model", "T", "strategy", "B", "simulated µs", "roofline µs", "ratio", "peak SRAM MB", "HBM MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i < 3 else "---:" for i in range(len(head))) + "|"]
    for r in rows:
        cells = [r.title, str(r.tokens), r.strategy, "-" if r.block is None else str(r.block),
                 bench._num(r.microseconds), bench._num(r.roofline_microseconds), f"{r.ratio:.2f}",
                 f"{r.peak_sram_bytes / 2**20:.1f}", f"{r.hbm_bytes / 2**20:,.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def best(rows: Sequence[Row]) -> str:
    """Per model and T, the strategy with the least simulated time."""
    out = []
    for key in dict.fromkeys((r.title, r.tokens) for r in rows):
        group = [r for r in rows if (r.title, r.tokens) == key]
        win = min(group, key=lambda r: r.total_cycles)
        out.append(f"- {key[0]} T = {key[1]}: {win.strategy}")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T = 1 and 64 only; no files unless --out")
    parser.add_argument("--out", type=Path, default=None, help="directory for strategies.md")
    args = parser.parse_args(argv)
    tokens = QUICK_TOKENS if args.quick else TOKENS
    rows = []
    for model in MODELS:
        for t in tokens:
            for strategy in STRATEGIES:
                row = strategy_row(model, t, strategy)
                print(f"  {model.title} T={t} {strategy}: {row.microseconds:,.1f} us, {row.ratio:.2f}x the roofline "
                      f"({row.simulate_seconds:.2f} s)", file=sys.stderr)
                rows.append(row)
    text = table(rows)
    print(text)
    out = args.out if args.out is not None else (None if args.quick else Path(__file__).parent)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/strategies.py" + (" --quick" if args.quick else "")
        doc = (__doc__ or "").split("\n\n", 1)[1]
        (out / "strategies.md").write_text(
            "# tcpc strategies side by side\n\n"
            f"Generated by `{command}`. Cost-only, balanced routing, default machine (RNGD, one cluster).\n\n"
            + doc.strip() + "\n\n" + text + "\nFastest strategy per model and T:\n\n" + best(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
