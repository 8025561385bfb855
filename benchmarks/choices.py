"""Choices by the cost model at real dims: the block size `block=auto` picks, against the fixed
rule of benchmarks/run.py, and the time the choice takes.

    python benchmarks/choices.py            # every family, decode T = 1, 16, 64
    python benchmarks/choices.py --quick    # T = 1 and 16
    python benchmarks/choices.py --tokens 1 64 --out DIR   # writes DIR/choices.md too

For every model family (examples/*.moe at the dims of benchmarks/run.py) and T, the program is
compiled with a block that cannot fit (B = 2^31 - 1), so the compiler picks it (tcpc/autotune.py):
each candidate is compiled and simulated cost-only with balanced routing. Each row gives the
candidates' cycles, the chosen block, the block of run.py's rule (B = the next power of two >=
ceil(T*K / E), at most 64) with its cycles (simulated here when it was not a candidate, or one
whose cycles the choice bounded, `>= N`, rather than simulated), how
much fewer cycles the choice takes than the rule, and the wall-clock seconds of the choice.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

import tcpc  # noqa: E402
from run import MODELS, Model, block_size  # noqa: E402

TOKENS: tuple[int, ...] = (1, 16, 64)
QUICK_TOKENS: tuple[int, ...] = (1, 16)
UNFIT = 2**31 - 1
"""A block no T fits: auto is then the default."""


@dataclass(frozen=True)
class Row:
    model: str
    title: str
    tokens: int
    alternatives: tuple[tuple[int, int], ...]
    """(block, cycles) of every candidate."""
    chosen: int
    rule_block: int
    rule_cycles: int
    seconds: float
    """Wall clock of the compile with the choice."""
    bounded: tuple[int, ...] = ()
    """Candidates whose cycles are a lower bound, not simulated (Choice.bounded)."""

    @property
    def chosen_cycles(self) -> int:
        return dict(self.alternatives)[self.chosen]


def choice_row(model: Model, tokens: int, dims: dict[str, int] | None = None) -> Row:
    """Compile `model` at T = tokens (or `dims`, whose B is replaced) with a block that cannot fit."""
    dims = {**(dims or model.dims), "T": tokens, "B": UNFIT}
    start = time.perf_counter()
    program = tcpc.compile_file(model.path, dims=dims)
    seconds = time.perf_counter() - start
    (choice,) = program.choices
    alternatives = tuple((int(b), c) for b, c in choice.alternatives)
    bounded = tuple(int(b) for b in choice.bounded)
    rule = min(block_size(tokens, dims["K"], dims["E"]), tokens)
    cycles = None if rule in bounded else dict(alternatives).get(rule)
    if cycles is None:
        ruled = tcpc.compile_file(model.path, dims={**dims, "B": rule})
        cycles = ruled.simulate(cost_only=True).report.total_cycles
    return Row(model.name, model.title, tokens, alternatives, int(choice.chosen), rule, cycles, seconds, bounded)


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| model | T | cycles by candidate block | chosen B | rule B | rule cycles | chosen / rule | choice s |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        tried = ", ".join(f"{b}: {'>= ' if b in r.bounded else ''}{c:,}" for b, c in r.alternatives)
        lines.append(f"| {r.title} | {r.tokens} | {tried} | {r.chosen} | {r.rule_block} | {r.rule_cycles:,} | "
                     f"{r.chosen_cycles / r.rule_cycles:.3f} | {r.seconds:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"T in {QUICK_TOKENS} only")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="the T values (default: decode)")
    parser.add_argument("--out", type=Path, default=None, help="also write choices.md here")
    args = parser.parse_args(argv)
    tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    rows = []
    for model in MODELS:
        for t in tokens:
            rows.append(choice_row(model, t))
            print(f"  {model.title} T = {t}: B = {rows[-1].chosen} ({rows[-1].seconds:.1f} s)", file=sys.stderr, flush=True)
    text = table(rows)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "choices.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
