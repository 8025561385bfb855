"""Simulation time against the length of the program: the simulator must stay O(n log n) in ops.

    python benchmarks/scale.py                 # 1,000 / 4,000 / 10,000 / 20,000 ops
    python benchmarks/scale.py --ops 500 2000  # other sizes

The programs are hand-written lowered IR (`long_program`): a chain of N commands on 1 KB
tensors, mostly `ve` elementwise ops, a `tcp.contract` every fourth op and a `tcp.load` every
50th. Each op reads the previous value and one more: usually one of the last few, sometimes
(`far`) any earlier value, so some buffers stay live for a long stretch of the program, as a
layer's inputs and routing tables do. Each program is simulated twice:

- `roomy`: on the default machine (RNGD: 128 MB of SRAM), where everything fits;
- `tight`: on the same machine with 4 KB of SRAM (`tight_machine`, an artificial machine for
  this benchmark only), so that most commands must spill a buffer first: the planner's spill
  path runs at nearly every op.

Columns: ops in the program, commands scheduled (the program's plus the plan's spills and
reloads), spills, and the seconds `simulate` took (interpretation, costing, memory plan,
scheduling and report, end to end), one run each.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from xdsl.dialects.builtin import ModuleOp  # noqa: E402
from xdsl.parser import Parser  # noqa: E402

from target.machine import Machine, default_machine  # noqa: E402
from runtime_sim.perf.simulate import SimResult, simulate  # noqa: E402
from tcpc.pipelines import make_context  # noqa: E402

SIZES = (1_000, 4_000, 10_000, 20_000)
TENSOR = "tensor<8x32xf32>"
"""Every value: 8 x 32 f32, 1 KB."""
TIGHT_SRAM_BYTES = 4 * 1024
BINARY_OPS = ("ve.max", "ve.mul", "ve.min")
"""Ops that keep values in [0, 1] however long the chain (no overflow to inf or NaN)."""


def long_program(ops: int, window: int = 8, far: float = 0.05, seed: int = 0) -> str:
    """Lowered IR of `ops` commands: function `f`, one argument %x (an 8x32 f32 tensor) and
    the last value as its result. Op i reads value i-1 and value j: one of the `window`
    before it, or with probability `far` any earlier one."""
    rnd = np.random.default_rng(seed)
    t = TENSOR
    lines = [f"  %v0 = tcp.load %x : {t} -> {t}"]
    for i in range(1, ops):
        if i % 50 == 0:
            lines.append(f"  %v{i} = tcp.load %x : {t} -> {t}")
            continue
        j = int(rnd.integers(0, i)) if rnd.random() < far else max(0, i - 1 - int(rnd.integers(0, window)))
        if i % 4 == 0:
            lines.append(f'  %v{i} = tcp.contract "ij,ij->ij" %v{i - 1}, %v{j} : {t}, {t} -> {t}')
        else:
            lines.append(f"  %v{i} = {BINARY_OPS[i % 3]} %v{i - 1}, %v{j} : {t}")
    return f"func.func @f(%x: {t}) -> {t} {{\n" + "\n".join(lines) + f"\n  func.return %v{ops - 1} : {t}\n}}"


def parse_program(text: str) -> ModuleOp:
    module = Parser(make_context(), text).parse_module()
    module.verify()
    return module


def program_input() -> np.ndarray:
    """The argument %x: distinct values in [0.5, 1]."""
    return np.linspace(0.5, 1.0, 8 * 32, dtype=np.float32).reshape(8, 32)


def tight_machine() -> Machine:
    """The default machine with 4 KB of SRAM per cluster (an assumption of this benchmark: no
    real machine), so that the programs' live buffers, all on cluster 0's engines and so in its
    SRAM, do not fit and the plan spills."""
    machine = default_machine()
    return replace(machine, name=f"{machine.name}-4KB", sram_bytes_per_slice=TIGHT_SRAM_BYTES // machine.slices)


def simulate_program(module: ModuleOp, machine: Machine) -> SimResult:
    return simulate(module, "f", [program_input()], machine)


@dataclass(frozen=True)
class Row:
    ops: int
    roomy_commands: int
    roomy_seconds: float
    tight_commands: int
    tight_spills: int
    tight_seconds: float


def measure(ops: int) -> Row:
    module = parse_program(long_program(ops))
    start = time.perf_counter()
    roomy = simulate_program(module, default_machine()).report
    middle = time.perf_counter()
    tight = simulate_program(module, tight_machine()).report
    end = time.perf_counter()
    return Row(ops, len(roomy.ops), middle - start, len(tight.ops), len(tight.spills), end - middle)


def table(rows: Sequence[Row]) -> str:
    lines = ["| ops | roomy: commands | roomy: seconds | tight: commands | tight: spills | tight: seconds |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.ops:,} | {r.roomy_commands:,} | {r.roomy_seconds:.2f} | {r.tight_commands:,} | "
              f"{r.tight_spills:,} | {r.tight_seconds:.2f} |" for r in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, nargs="+", default=list(SIZES), help="program lengths to simulate")
    args = parser.parse_args(argv)
    rows = []
    for ops in args.ops:
        rows.append(measure(ops))
        print(f"{ops:,} ops done", file=sys.stderr, flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
