"""Expert parallelism across chips: DeepSeek-V3 and Qwen3-30B-A3B sharded over meshes of RNGD
cards, a2a against a2a_sum and allgather, balanced against skewed routing, on the mesh simulator.

    python benchmarks/mesh.py            # the default table (394 to 747 s on a 2-core VM, one process): benchmarks/mesh.md
    python benchmarks/mesh.py --quick    # DeepSeek-V3 on 8 chips, T = 1 and 16; prints the table
    python benchmarks/mesh.py --full     # every T and strategy at every mesh size (not run for the table)
    python benchmarks/mesh.py --model qwen3_moe --tokens 4096 --out rows.md   # only the plan's rows that match
    python benchmarks/mesh.py --seed-mesh --out rows.md   # seed 001's meshes: DeepSeek-V3 on ep=4, 8, 16 x sp=8

Every run is cost-only (real dims do not fit in memory), the layer sharded by `shard-experts`
(`tcpc run --mesh`), lowered by the single-chip pipeline and simulated on every chip of the
default mesh machine (target/machines/rngd_pcie.toml: RNGD chips, a 30 B/cycle PCIe
link each). T is tokens per chip: decode 1, 16, 128, prefill 4096; the default plan takes
25 of these combinations (`runs`), `--full` all of them. A row may split every expert over
tp chips as well (`--mesh ep=N/tp,tp=...`: the tp chips of a group share their T tokens). The
block size B is chosen by the cost model as `tcpc run --mesh` chooses block=auto, on the mesh
(`tcpc.mesh_run.compile_for_mesh`: tcpc/autotune.py's candidates around the rows an expert receives
under balanced routing, each simulated on every chip with the row's routing, the fewest
cycles kept; every candidate's cycles are listed under the table); lower-topk's strategy is
chosen by cost as well (`topk=auto`: each strategy simulated on the mesh, the cheaper kept), and
so is the chunk count of a2a and a2a_sum (`chunks=auto`: the chip's token loop in 1, 2, 4 or 8
software-pipelined chunks, each count simulated with each candidate block; the `chunks`
column). `link busy` is the slowest chip's link busy time (its collectives' transfers and
waits) over its total time. Every row draws its routing from seed 1 (a skewed routing's hot
experts depend on it): `tcpc run ... --mesh ... --seed 1` reproduces a row, where the CLI's
default seed, 0, gives another skewed draw.

Each row: the simulated time (the slowest chip), the share of it the slowest chip spends in
collectives (waiting included), and the ratio to a lower bound computed here from two limits,
neither of which the simulator can beat:
- the chip limit: the largest among the chips of each chip's own limit for the routing used,
  computed here, not taken from the simulator's counters: max(FLOPs / 256 TFLOPS, minimal HBM
  bytes / 1.5 TB/s) (schedule.py's `work_limit`, on the chip's SPMD program from
  shard-experts before lowering): its tokens' router and shared expert (every matmul's
  2 M N K), 2 x D x F (F / tp with tp) per projection for every pair routed to one of its
  experts; its arguments once (its tokens, the router, the shared expert), of its experts'
  weights only those of experts that receive a pair, once each; its output rows written once;
- the link limit: for the routing used, the rows that must cross each chip's link in each
  direction (a token's row to every other chip holding one of its experts, once, and the
  result back: DeepEP's deduplicated dispatch), at the link's bandwidth (with tp, among the
  ep chips of one tp slice; the partial sums' reduction is not counted, so it stays a bound).
On seed 001's meshes (`--seed-mesh`: ep=R,sp=8, R rows of 8 chips, each chip with its own
tokens and E / (8R) experts) the link limit adds the sp all-gather of the row's tokens and the
reduce-scatter of its outputs, (sp - 1) rows of the chip's own tokens each way for each, bf16
(the minimum: seed 001 moves bf16 activations, as these rows' reduce-scatter does with
`sp_sum=bf16`, SEED_SP_SUM), to the all-to-all's rows within the chip's column, counted as
above among the column's chips.
The bound is the larger (compute and communication overlapping perfectly). The last column is
where the slowest chip's time goes: its critical path by phase (dispatch and combine include
their collectives, waits included).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import tcpc  # noqa: E402
from tcpc.program import function_in  # noqa: E402
from target.mesh_machine import MeshMachine, load_mesh_machine  # noqa: E402
from runtime_sim.perf.mesh_simulate import AboveBound, MeshReport  # noqa: E402
from dialects.annotations import PHASES  # noqa: E402
from tcpc.mesh_run import MeshSpec, compile_for_mesh, simulate_on_mesh  # noqa: E402
from passes.mesh.shard_experts import CHUNKED_STRATEGIES  # noqa: E402

if str(ROOT / "benchmarks") not in sys.path:  # schedule.py, the chip limit, next to this script
    sys.path.insert(0, str(ROOT / "benchmarks"))

from schedule import work_limit  # noqa: E402

EXAMPLES = ROOT / "examples"


@dataclass(frozen=True)
class Model:
    name: str
    title: str
    dims: dict[str, int]
    chips: tuple[int, ...]


MODELS = (
    Model("deepseek_v3", "DeepSeek-V3", dict(D=7168, F=2048, FS=2048, E=256, K=8, NG=8, TG=4), (8, 16, 32)),
    Model("qwen3_moe", "Qwen3-30B-A3B", dict(D=2048, F=768, E=128, K=8), (2, 4, 8)),
)
DECODE = (1, 16, 128)
PREFILL = 4096
SEED_ROWS = (4, 8, 16)
"""Seed 001's meshes: (4, 8), (8, 8) and (16, 8) devices, rows x 8 columns (`ep=R,sp=8`)."""
SEED_COLUMNS = 8
SEED_DECODE = 4
"""Tokens per chip of the seed's decode step: 32 a row of 8 chips (its B_local per device row)."""
SEED_PREFILL = 128
"""Tokens per chip of a prefill row on the seed's meshes (1,024 a row of 8)."""
SEED_CHUNKS = (2, 1)
"""The chunk counts a seed prefill row simulates, the fewest cycles kept (the `chunks` column;
`Chunks tried` under the table), the one that wins first: the next stops once a chip's lower bound
passes its cycles (`mesh_row`). Not chunks=auto's four: a 128-chip prefill simulation takes
about 10 CPU s in one chunk, 25 in two. Decode rows run one chunk (not tried)."""
SEED_SP_SUM = "bf16"
"""The seed rows' reduce-scatter: each column's sum rounded to bf16 before it crosses, as seed
001's bf16 reduce-scatter (docs/mesh.md: a2a_sum's kind of tolerance); f32 moves twice the bytes."""
SKEWED_WAVES = {"deepseek_v3": 5, "qwen3_moe": 3}
"""A skewed a2a row's split pairs go back in this many waves under the expert loop and one after
it (`--mesh ...,waves=N`: each once the receiver's blocks of its range of experts are computed,
docs/passes.md, return-waves), the `mesh` column says so. Chosen by hand from simulating each
row (DeepSeek-V3 at 16 a chip, waves = 1, 3, 4, 5, 6: 2,330.5 / 2,098.6 / 2,094.7 / 2,094.5 /
2,097.3 us; Qwen3-30B-A3B ep=2, waves = 2, 3, 4, 6: 398.1 / 397.1 / 396.8 / 396.7 us): not yet a
choice of the cost model as chunks=auto is."""
SEED_BLOCK = 0
"""A seed row's block: 0 for the pairs an expert receives under balanced routing
(T * K / E, as autotune's centre candidate), not searched: the search simulates every
candidate on every chip."""


def link_bound_cycles(choices: np.ndarray, chips: int, experts: int, row_bytes: int, machine: MeshMachine) -> float:
    """The link limit: per chip, rows that must leave and enter it (dispatch and return), over
    the link's bandwidth; the largest over chips."""
    tokens = choices.shape[0] // chips
    owner = choices // (experts // chips)
    home = np.repeat(np.arange(chips), tokens)
    out = np.zeros(chips)
    into = np.zeros(chips)
    for c in range(chips):
        remote = (owner == c).any(axis=1) & (home != c)  # tokens of other chips that need chip c
        into[c] += remote.sum()          # their rows arrive at c
        out[c] += remote.sum()           # and their results leave c
        mine = home == c
        needs = [(owner[mine] == d).any(axis=1).sum() for d in range(chips) if d != c]
        out[c] += sum(needs)             # c's tokens leave for the other chips
        into[c] += sum(needs)            # and their results come back
    return float(np.maximum(out, into).max() * row_bytes / machine.link_bytes_per_cycle)


def sp_link_bound_cycles(choices: np.ndarray, ep: int, sp: int, experts: int, row_bytes: int,
                         machine: MeshMachine) -> float:
    """The link limit on an ep x sp mesh (module docstring): the largest over the columns of
    their all-to-all's (`link_bound_cycles` on the column's pairs, other experts none), plus
    the sp all-gather's and reduce-scatter's (sp - 1) rows of the chip's own tokens each way."""
    column = experts // sp
    a2a = max(link_bound_cycles(np.where(choices // column == j, choices % column, -1), ep, column, row_bytes,
                                machine) for j in range(sp))
    own = choices.shape[0] // (ep * sp)
    return a2a + 2 * (sp - 1) * own * row_bytes / machine.link_bytes_per_cycle


def chip_limit_cycles(program: tcpc.Program, spec: MeshSpec, choices: np.ndarray, experts: int,
                      machine: MeshMachine) -> list[float]:
    """Each chip's limit in cycles for the routing `choices` (every token's experts, [T, K];
    module docstring): the chip's SPMD program before lowering, the pairs routed to its
    experts and how many of them receive one."""
    graph = program.function()
    sharded = function_in(program.lower(spec.pipeline(lowered=False)), graph.sym_name.data)
    mesh = spec.mesh
    local = experts // mesh.expert_shards
    limits = []
    for c in range(mesh.chips):
        mine = choices[choices // local == mesh.expert_shard(c)]
        work = work_limit(sharded, int(mine.size), len(np.unique(mine)), local)
        limits.append(work.seconds * machine.chip.clock_hz)
    return limits


@dataclass
class Row:
    model: str
    chips: int
    tokens: int
    strategy: str
    routing: str
    total_cycles: int
    communication_cycles: int
    chip_bound: float
    link_bound: float
    hot_chip: int
    imbalance: float
    seconds: float
    tp: int = 1
    topk: str = ""
    phases: dict[str, int] | None = None
    """The slowest chip's critical-path cycles by phase."""
    block: int = 0
    tried: tuple[tuple[int, int], ...] = ()
    """(block, cycles) of every block the cost model tried (empty: the block was given)."""
    chunks: int = 1
    """The chunk count the cost model chose (chunks=auto)."""
    link_busy: int = 0
    """The slowest chip's link busy cycles."""
    sp: int = 1
    """The sp axis (seed 001's columns); `chips` counts its chips."""
    cpu_seconds: float = 0.0
    """The process's CPU time for the row (every chip's thread): `seconds` is wall time, which
    other work on the machine inflates."""
    bounded: tuple[int, ...] = ()
    """The blocks of `tried` whose cycles are a lower bound: their simulation stopped once a chip's
    lower bound (its roofline, its busiest unit, its longest path) passed the fewest cycles found (they cannot win)."""
    sp_sum: str = "f32"
    """With sp, the type the columns' sums cross the reduce-scatter in (`--mesh ...,sp_sum=`)."""
    chunks_tried: tuple[tuple[int, int], ...] = ()
    """(chunks, cycles) of every count simulated (`mesh_row`'s chunk_counts; empty: not tried)."""
    chunks_bounded: tuple[int, ...] = ()
    """The counts of `chunks_tried` whose cycles are a lower bound (as `bounded`'s blocks)."""
    waves: int = 1
    """a2a's split pairs returned in this many waves (SKEWED_WAVES)."""

    @property
    def mesh(self) -> str:
        return (f"ep={self.chips // self.tp // self.sp}" + (f",sp={self.sp}" if self.sp > 1 else "")
                + (f",tp={self.tp}" if self.tp > 1 else "")
                + (f",sp_sum={self.sp_sum}" if self.sp_sum != "f32" else "")
                + (f",waves={self.waves}" if self.waves > 1 else ""))

    @property
    def bound(self) -> float:
        return max(self.chip_bound, self.link_bound)

    @property
    def ratio(self) -> float:
        return self.total_cycles / self.bound if self.bound else math.inf


def mesh_row(model: Model, chips: int, tokens: int, strategy: str, routing: str,
             dims: dict[str, int] | None = None, machine: MeshMachine | None = None, tp: int = 1,
             block: int | None = None, sp: int = 1, search: bool = True, sp_sum: str = "f32",
             chunk_counts: tuple[int, ...] = ()) -> Row:
    """One cost-only run of `model` with `tokens` per token shard on `chips` chips
    (ep = chips / (tp * sp); the tp chips of a group share their tokens, the sp chips do not);
    the block size `block`, or chosen by the cost model on the mesh
    (`tcpc.mesh_run.compile_for_mesh`). `search`: the chunk count and lower-topk's strategy
    chosen by simulating each (chunks=auto, topk=auto); else 1 chunk and the default. `sp_sum`:
    the type of sp's reduce-scatter (f32, bf16). `chunk_counts` (with a given block, no search):
    each count simulated in turn, its block `block` / count (an expert's pairs in a chunk), the fewest
    cycles kept (the row's chunks and B); a count stops once a chip's lower bound passes the fewest so
    far (its cycles then that bound, `chunks_bounded`)."""
    machine = machine or load_mesh_machine()
    ep = chips // tp // sp
    d = dict(dims or model.dims)
    d["T"] = tokens * ep * sp
    start, cpu = time.perf_counter(), time.process_time()
    waves = SKEWED_WAVES.get(model.name, 1) if routing == "skewed" and strategy == "a2a" and sp == tp == 1 else 1
    spec = (f"ep={ep}" + (f",sp={sp},sp_sum={sp_sum}" if sp > 1 else "") + (f",tp={tp}" if tp > 1 else "")
            + f",strategy={strategy}" + (f",waves={waves}" if waves > 1 else "")) + (
        ",chunks=auto" if strategy in CHUNKED_STRATEGIES and search and waves == 1 else "")
    tried: tuple[tuple[int, int], ...] = ()
    chunks_tried: tuple[tuple[int, int], ...] = ()
    chunks_bounded: tuple[int, ...] = ()
    bounded: tuple[int, ...] = ()
    if block is None:  # as `tcpc run --mesh` chooses block=auto: on the mesh, for the row's routing
        program = compile_for_mesh(EXAMPLES / f"{model.name}.moe", d, MeshSpec.parse(spec), machine=machine,
                                   routing=routing, seed=1)
        choice = next(c for c in program.choices if c.what == "block")
        block, tried, bounded = int(choice.chosen), choice.alternatives, choice.bounded  # type: ignore[assignment]
    elif chunk_counts:
        runs = []
        tried_counts: list[tuple[int, int]] = []
        for count in chunk_counts:
            b = max(1, block // count)
            trial = tcpc.compile_file(EXAMPLES / f"{model.name}.moe", dims={**d, "B": b})
            bar = min((r[0].report.total_cycles for r in runs), default=math.inf)
            try:  # stopped once a chip's lower bound passes the fewest cycles so far (it cannot win)
                runs.append((simulate_on_mesh(trial, MeshSpec.parse(f"{spec},chunks={count}"), cost_only=True,
                                              routing=routing, seed=1, machine=machine, bound_above=bar), trial, b))
                tried_counts.append((count, runs[-1][0].report.total_cycles))
            except AboveBound as e:
                tried_counts.append((count, e.cycles))
                chunks_bounded += (count,)
        chunks_tried = tuple(tried_counts)
        sim, program, block = min(runs, key=lambda r: r[0].report.total_cycles)
    else:
        program = tcpc.compile_file(EXAMPLES / f"{model.name}.moe", dims={**d, "B": block})
    d["B"] = block
    if not chunk_counts or search:
        sim = simulate_on_mesh(program, MeshSpec.parse(spec + (",topk=auto" if search else "")), cost_only=True,
                               routing=routing, seed=1, machine=machine)
    report: MeshReport = sim.report
    choices = next(iter(report.routing.values())).choices
    # The chip's own work, whatever its chunks and waves (one chunk's weights loaded once is the minimum).
    chip_limits = chip_limit_cycles(program, replace(MeshSpec.parse(spec), chunks=1, waves=1), choices, d["E"], machine)
    row_bytes = 2 * d["D"]
    busy = [report.compute_busy(c) for c in range(chips)]
    slowest = max(range(chips), key=lambda c: report.chips[c].total_cycles)
    topk = min(sim.topk_cycles, key=sim.topk_cycles.__getitem__) if sim.topk_cycles else "" if search else "rank"
    chunks = next((int(c.chosen) for c in report.choices if c.what == "chunk count"),
                  min((t for t in chunks_tried if t[0] not in chunks_bounded), key=lambda t: t[1])[0]
                  if chunks_tried else 1)
    link = (sp_link_bound_cycles(choices, ep, sp, d["E"], row_bytes, machine) if sp > 1
            else link_bound_cycles(choices, ep, d["E"], row_bytes, machine))
    return Row(model.title, chips, tokens, strategy, routing, report.total_cycles, report.communication_cycles,
               max(chip_limits), link,
               max(range(chips), key=busy.__getitem__), report.imbalance(busy), time.perf_counter() - start,
               tp, topk, {p.name: p.critical_cycles for p in report.chips[slowest].phases}, block, tried, chunks,
               report.link_busy(slowest), sp, time.process_time() - cpu, bounded, sp_sum if sp > 1 else "f32",
               chunks_tried, chunks_bounded, waves)


def table(rows: list[Row], clock_hz: float = 1e9, cpu: bool = False) -> str:
    """The rows as a markdown table; `cpu`: with each row's CPU s after its wall s."""
    us = 1e6 / clock_hz
    lines = ["| model | chips | mesh | T per chip | strategy | routing | simulated µs | collectives | chip bound µs | "
             "link bound µs | ratio to bound | chunks | link busy | busiest chip | imbalance | top-k | B | "
             "slowest chip by phase, µs | wall s |" + (" CPU s |" if cpu else ""),
             "|---|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|"
             + ("---:|" if cpu else "")]
    for r in rows:
        mesh = r.mesh
        phases = ", ".join(f"{p} {(r.phases or {})[p] * us:,.1f}" for p in PHASES if (r.phases or {}).get(p))
        lines.append(f"| {r.model} | {r.chips} | {mesh} | {r.tokens} | {r.strategy} | {r.routing} | "
                     f"{r.total_cycles * us:,.1f} | "
                     f"{r.communication_cycles / r.total_cycles:.0%} | {r.chip_bound * us:,.1f} | {r.link_bound * us:,.1f} | "
                     f"{r.ratio:.2f} | {r.chunks} | {r.link_busy / r.total_cycles:.0%} | {r.hot_chip} | {r.imbalance:.2f} | "
                     f"{r.topk} | {r.block} | {phases} | {r.seconds:.1f} |" + (f" {r.cpu_seconds:.1f} |" if cpu else ""))
    return "\n".join(lines) + "\n"


def tried_chunks(rows: list[Row], clock_hz: float = 1e9) -> str:
    """Every chunk count simulated for each row that tried several, with its simulated µs."""
    us = 1e6 / clock_hz
    lines = ["Chunks tried (chunks: simulated µs; B is the pairs an expert receives in a chunk; >= a lower bound "
             "where the simulation stopped once a chip's passed the fewest µs found):", ""]
    lines += [f"- {r.model}, {r.mesh}, T = {r.tokens} per chip, {r.strategy}: "
              + ", ".join(f"{c}: {'>= ' if c in r.chunks_bounded else ''}{cycles * us:,.1f}" for c, cycles in r.chunks_tried)
              for r in rows if r.chunks_tried]
    return "\n".join(lines) + "\n"


def tried_blocks(rows: list[Row], clock_hz: float = 1e9) -> str:
    """Every block size the cost model tried for each row, with its simulated µs."""
    us = 1e6 / clock_hz
    lines = ["Blocks tried (B: simulated µs, lower-topk's default strategy; >= the fewest µs found when it was tried, "
             "where the simulation stopped once a chip's lower bound (its roofline, its busiest unit, its longest path) "
             "passed them):", ""]
    for r in rows:
        mesh = r.mesh
        tried = ", ".join(f"{b}: {'>= ' if b in r.bounded else ''}{c * us:,.1f}" for b, c in r.tried) or f"given, {r.block}"
        lines.append(f"- {r.model}, {mesh}, T = {r.tokens} per chip, {r.strategy}, {r.routing}: {tried}")
    return "\n".join(lines) + "\n"


Run = tuple[Model, int, int, str, str, int, int | None]
"""(model, chips, T per chip, strategy, routing, tp, block: None to choose it by cost)."""


def runs(quick: bool, full: bool = False) -> list[Run]:
    """The default plan (the module docstring gives its wall time): DeepSeek-V3 on 8 chips at T = 1, 16 and 128 per chip,
    a2a against allgather and balanced against skewed at T = 16, and with tp = 2; DeepSeek-V3
    a2a balanced on 16 and 32 chips at T = 16; Qwen3 at T = 16 on every mesh size, and on 4
    chips as ep=2,tp=2; prefill (4096 tokens per chip, balanced) for DeepSeek-V3 on 8 chips
    and Qwen3 on 2, 4 and 8, a2a against a2a_sum, and allgather on both; a2a_sum at T = 128
    for DeepSeek-V3.
    `full`: every T and strategy at every mesh size (not run for the table)."""
    if quick:
        return [(MODELS[0], 8, t, "a2a", "balanced", 1, None) for t in DECODE[:2]]
    if full:
        return [(model, chips, t, s, r, 1, None) for model in MODELS for chips in model.chips
                for t in (*DECODE, PREFILL)
                for s, r in (("a2a", "balanced"), ("a2a", "skewed"), ("a2a_sum", "balanced"), ("allgather", "balanced"))]
    deepseek, qwen = MODELS
    plan: list[Run] = [(deepseek, 8, t, "a2a", "balanced", 1, None) for t in DECODE]
    plan += [(deepseek, 8, 16, "a2a", "skewed", 1, None), (deepseek, 8, 16, "allgather", "balanced", 1, None),
             (deepseek, 8, 16, "a2a", "balanced", 2, None)]
    plan += [(deepseek, chips, 16, "a2a", "balanced", 1, None) for chips in deepseek.chips[1:]]
    plan += [(qwen, chips, 16, "a2a", "balanced", 1, None) for chips in qwen.chips]
    plan += [(qwen, 2, 16, "a2a", "skewed", 1, None), (qwen, 2, 16, "allgather", "balanced", 1, None),
             (qwen, 4, 16, "a2a", "balanced", 2, None)]
    plan += [(deepseek, 8, 128, "a2a_sum", "balanced", 1, None)]
    plan += [(deepseek, 8, PREFILL, "a2a", "balanced", 1, None), (deepseek, 8, PREFILL, "allgather", "balanced", 1, None),
             (deepseek, 8, PREFILL, "a2a_sum", "balanced", 1, None)]
    plan += [(qwen, chips, PREFILL, s, "balanced", 1, None) for chips in qwen.chips for s in ("a2a", "a2a_sum")]
    plan += [(qwen, 2, PREFILL, "allgather", "balanced", 1, None)]
    return plan


def seed_rows(machine: MeshMachine, chips: int | None = None, tokens: int | None = None,
              strategy: str | None = None) -> list[Row]:
    """Seed 001's meshes: DeepSeek-V3 on ep=R,sp=8 for R in SEED_ROWS, decode (SEED_DECODE per
    chip) and prefill (SEED_PREFILL per chip), a2a and a2a_sum, balanced routing, one chunk at
    decode and SEED_CHUNKS' counts at prefill, lower-topk's default strategy, the block SEED_BLOCK says and SEED_SP_SUM's reduce-scatter; `chips`, `tokens` and
    `strategy` filter them. Each row's line is printed as it is done."""
    deepseek = MODELS[0]
    rows = []
    for r in SEED_ROWS:
        for t in (SEED_DECODE, SEED_PREFILL):
            for s in ("a2a", "a2a_sum"):
                if (chips or r * SEED_COLUMNS) != r * SEED_COLUMNS or (tokens or t) != t or (strategy or s) != s:
                    continue
                n = r * SEED_COLUMNS
                block = SEED_BLOCK or max(1, t * n * deepseek.dims["K"] // deepseek.dims["E"])
                rows.append(mesh_row(deepseek, n, t, s, "balanced", machine=machine, block=block,
                                     sp=SEED_COLUMNS, search=False, sp_sum=SEED_SP_SUM,
                                     chunk_counts=SEED_CHUNKS if t == SEED_PREFILL else ()))
                print(table(rows[-1:], cpu=True).splitlines()[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="DeepSeek-V3 on 8 chips, T = 1 and 16")
    parser.add_argument("--full", action="store_true", help="every T and strategy at every mesh size (hours)")
    parser.add_argument("--out", default=None, help="write the table here (default: benchmarks/mesh.md unless --quick "
                                                    "or a filter)")
    parser.add_argument("--model", choices=[m.name for m in MODELS], help="only this model's rows")
    parser.add_argument("--tokens", type=int, help="only the rows of this T per chip")
    parser.add_argument("--chips", type=int, help="only the rows of this many chips")
    parser.add_argument("--strategy", help="only the rows of this strategy")
    parser.add_argument("--seed-mesh", action="store_true",
                        help="seed 001's meshes instead of the plan: DeepSeek-V3 on ep=4, 8, 16 x sp=8 (seed_rows)")
    args = parser.parse_args(argv)
    machine = load_mesh_machine()
    rows = []
    start = time.perf_counter()
    if args.seed_mesh:
        rows = seed_rows(machine, args.chips, args.tokens, args.strategy)
        text = (table(rows, cpu=True) + f"\nWall time of the run: {time.perf_counter() - start:,.0f} s (one process).\n\n"
                + tried_chunks(rows))
        print(text)
        if args.out:
            Path(args.out).write_text(text)
        return 0
    plan = [r for r in runs(args.quick, args.full)
            if (args.model is None or r[0].name == args.model) and (args.tokens is None or r[2] == args.tokens)
            and (args.chips is None or r[1] == args.chips) and (args.strategy is None or r[3] == args.strategy)]
    filtered = any(v is not None for v in (args.model, args.tokens, args.chips, args.strategy))
    if not plan:
        parser.error("no row of the plan matches the filters")
    for model, chips, tokens, strategy, routing, tp, block in plan:
        rows.append(mesh_row(model, chips, tokens, strategy, routing, machine=machine, tp=tp, block=block))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = (table(rows) + f"\nWall time of the run: {time.perf_counter() - start:,.0f} s (one process; the wall s "
            "column is each row's, block search included).\n\n" + tried_blocks(rows))
    print(text)
    out = args.out or (None if args.quick or filtered else str(Path(__file__).parent / "mesh.md"))
    if out:
        Path(out).write_text(f"Generated by `python benchmarks/mesh.py` on {machine.name} "
                             f"({machine.chip.name} chips).\n\n{text}")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
