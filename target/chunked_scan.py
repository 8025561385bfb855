"""The chunked cumsum's rule, shared by lower-routing (which emits it) and the cost of the mesh's
index ops (`ccl.a2a_plan` and the others, charged as the routing's equivalent with chips for
experts): a scan takes a step per element of its axis whatever the rows beside it, so a long
axis over few rows runs in chunks side by side (docs/passes.md, lower-routing)."""

from __future__ import annotations

from target.machine import Machine

MIN_CHUNKED_PAIRS = 256
"""From this many pairs the cumsum over pairs runs in chunks (`scan_chunks`). Below it the
scan's P steps are as few as the extra ops' fixed overheads (a rule of thumb: at P = 256,
16 chunks of 16 steps and 16 steps over the chunks against 256)."""


def scan_rows_of(machine: Machine) -> int:
    """Rows the vector engine scans side by side in one round: one cluster's slices times the
    integer stages' ways (RNGD: 256 x 8 = 2,048; the routing runs on one cluster). A scan of
    more rows takes another round of its steps (runtime_sim/perf/vector_cost.py,
    `scan_cycles`). lower-routing's `scan_rows` option overrides it."""
    return machine.slices * machine.int_ways


def scan_chunks(pairs: int, experts: int, scan_rows: int) -> int:
    """S, how many chunks the cumsum over pairs runs in: the divisor of P whose scans take
    the fewest steps (the fewest chunks on a tie), or 1 below MIN_CHUNKED_PAIRS. A scan takes
    a step per element of its axis whatever the rows beside it, so [P, E] with E = 128 lanes of
    work scans P steps while the vector engine could carry thousands of rows at once:
    [S, P / S, E] carries S * E rows for P / S steps, in rounds of `scan_rows` rows, and the
    chunk totals' cumsum and sum take S steps each. The rounds matter: the largest divisor
    below sqrt(P), the rule before, chose 84 chunks of 96 pairs at P = 8064, E = 64 (three
    rounds of 96 steps) and 64 of 127 at P = 8128 (two rounds), so that issue #12's layer
    routed T = 1008 tokens slower than 1016; both now take 32 chunks, one round of 252 and 254
    steps. The chunks must tile P exactly (a view); a prime P keeps one chunk."""
    if pairs < MIN_CHUNKED_PAIRS:
        return 1

    def steps(chunks: int) -> int:
        rounds = -(-chunks * experts // scan_rows)
        return rounds * (pairs // chunks) + 2 * -(-experts // scan_rows) * chunks

    return min((d for d in range(1, pairs + 1) if pairs % d == 0), key=lambda d: (steps(d), d))
