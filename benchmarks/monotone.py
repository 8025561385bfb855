"""Monotone simulated time: more tokens never fewer cycles, a bigger machine never more.

    python benchmarks/monotone.py                  # the whole sweep (about 3 minutes on 2 cores)
    python benchmarks/monotone.py --tokens 248 256 264   # some token counts only
    python benchmarks/monotone.py --skip-machines  # the token sweep only

The layer is issue #12's: a Mixtral-style block (examples/mixtral.moe) at D = 1024, F = 512,
E = 64, K = 8, B = 32, compiled with the full pipeline and simulated cost-only with balanced
routing on the default machine. Three sweeps:

- T from 128 to 1024 in steps of 8: the cycles must never fall as T grows;
- per-slice SRAM upward (T = 256), and HBM bandwidth upward (T = 256), as machine overrides of
  the default machine: the cycles must never grow.

Each table row is one run; `ok` is whether it keeps the order against the row before.
tests/test_monotone.py runs the pairs of this sweep that once broke it (and a few machine
steps) in the suite.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import tcpc  # noqa: E402
from runtime_sim.perf.cost_only import simulate_cost_only  # noqa: E402
from target.machine import Machine, default_machine  # noqa: E402

LAYER = ROOT / "examples" / "mixtral.moe"
DIMS: dict[str, int] = dict(D=1024, F=512, E=64, K=8, B=32)
"""The issue's Mixtral-style layer (every dim but T)."""
TOKENS: tuple[int, ...] = tuple(range(128, 1025, 8))
MACHINE_TOKENS = 256
SRAM_KB_PER_SLICE: tuple[int, ...] = (64, 96, 128, 256, 448, 512, 640, 1024)
"""Per-slice SRAM in KB, upward (RNGD: 512)."""
HBM_GB_PER_SECOND: tuple[int, ...] = (200, 400, 800, 1000, 1500, 2000, 3000)
"""HBM bandwidth in GB/s, upward (RNGD: 1,500)."""


def cycles(tokens: int, machine: Machine | None = None) -> int:
    """Simulated cycles of the layer at T = tokens on `machine` (default RNGD)."""
    program = tcpc.compile_file(LAYER, dims={**DIMS, "T": tokens})
    module = program.lower("pin-routing," + program.full_pipeline())
    return simulate_cost_only(module, program.function().sym_name.data, machine, routing="balanced").report.total_cycles


def with_sram(kb_per_slice: int) -> Machine:
    """The default machine with `kb_per_slice` KB of SRAM per slice (an override for this sweep)."""
    machine = default_machine()
    return replace(machine, name=f"{machine.name}-sram{kb_per_slice}k", sram_bytes_per_slice=kb_per_slice * 1024)


def with_hbm(gb_per_second: int) -> Machine:
    """The default machine with `gb_per_second` GB/s of HBM bandwidth (an override for this sweep)."""
    machine = default_machine()
    return replace(machine, name=f"{machine.name}-hbm{gb_per_second}", hbm_bytes_per_second=gb_per_second * 1e9)


def sweep(values: Sequence[int], run: Callable[[int], int], grows: bool) -> list[tuple[int, int, bool]]:
    """(value, cycles, kept the order) per value: `grows` means cycles may not fall."""
    rows: list[tuple[int, int, bool]] = []
    for v in values:
        c = run(v)
        ok = not rows or (c >= rows[-1][1] if grows else c <= rows[-1][1])
        rows.append((v, c, ok))
        print(f"  {v}: {c:,}{'' if ok else '  <- out of order'}", file=sys.stderr, flush=True)
    return rows


def table(title: str, unit: str, rows: Sequence[tuple[int, int, bool]]) -> str:
    lines = [f"{title}: {sum(not ok for _, _, ok in rows)} out of order", "",
             f"| {unit} | cycles | ok |", "|---:|---:|---|"]
    lines += [f"| {v:,} | {c:,} | {'yes' if ok else 'NO'} |" for v, c, ok in rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), metavar="T",
                        help="token counts of the T sweep (default: 128 to 1024 in steps of 8)")
    parser.add_argument("--skip-machines", action="store_true", help="only the T sweep")
    args = parser.parse_args(argv)
    parts = [table("T sweep (cycles never fall)", "T", sweep(sorted(args.tokens), cycles, grows=True))]
    if not args.skip_machines:
        parts.append(table(f"SRAM per slice at T = {MACHINE_TOKENS} (cycles never grow)", "KB per slice",
                           sweep(SRAM_KB_PER_SLICE, lambda kb: cycles(MACHINE_TOKENS, with_sram(kb)), grows=False)))
        parts.append(table(f"HBM bandwidth at T = {MACHINE_TOKENS} (cycles never grow)", "GB/s",
                           sweep(HBM_GB_PER_SECOND, lambda gb: cycles(MACHINE_TOKENS, with_hbm(gb)), grows=False)))
    text = "\n".join(parts)
    print(text)
    return 1 if "NO |" in text else 0


if __name__ == "__main__":
    raise SystemExit(main())
