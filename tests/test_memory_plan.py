"""The memory plan pinned: the same programs must keep giving exactly the same plan.

Each case simulates a program and records what the memory plan decided (every command it
scheduled with its dependencies, its spills, reloads, streams, refetches, residencies and
changed costs, the peak in issue order) and what came of it (the report: cycles, scheduled
peak, every op's slot). The numbers in PINNED were recorded before the planner was rewritten
for speed (a class with one method per mechanism, heaps in place of re-sorted lists), so these
tests prove the rewrite kept the behaviour. A deliberate change to the plan or to a cost
changes them: rerun `python tests/test_memory_plan.py` and paste its table. (Regenerated since,
each time checked against the old planner on the same code: schedule-experts skipping unused
blocks; the scheduler's best-fit unit choice and the DMA split into pieces; the DMA's pipelined
HBM <-> SRAM transfers; the whole chip, split-clusters; 32 MB token tiles; split-clusters' masked expert ids issued as
early as the routing makes them; a reused weight tile passed through, row tiles four blocks ahead;
the layer's output stored to HBM; each cluster's buffers in its own SRAM, residencies naming their
cluster; order=tile's slots after the first as a loop, whose free views of the slot tables are
rows of the report: same numbers, new digests; the roofline's padding bytes of a whole-buffer
store that moved only the blocks that ran, report JSON only: Mixtral-8x7B T = 64's digest; its
f32 router on the widened tokens' one bf16 piece, k x 3 piece pairs: 2,039,108 -> 2,038,884 cycles,
the same plan's numbers; the pinned routing read after the router's top-k (`tcp.order`), whose
last op cost-only runs no longer drop: 2,038,884 -> 2,038,905, the same plan's numbers.)

The cases cover every mechanism: no pressure, Belady spills and reloads, streams in and out,
DMA results fused into their readers with refetches, the `error` policy, and Mixtral-8x7B's
layer at T = 64 through the full pipeline (cost-only); its expert weights spilled until
schedule-experts tiled F, and now stream through SRAM as F tiles with no spill (pin regenerated
then). (The models at prefill take minutes since the schedule level: benchmarks, not tests.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import astuple, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from benchmark_scripts import load_script

import runtime_sim.perf.simulate as simulate_module
import tcpc
from runtime_sim.perf.free_space import FreeSpace
from target.machine import Machine, default_machine
from runtime_sim.perf.memory_plan import MemoryPlan, SramOverflowError
from runtime_sim.perf.op_trace import Trace, TracedOp
from runtime_sim.perf.report import SimReport

scale = load_script("scale")
MODELS = load_script("run").MODELS


def small_sram(sram_bytes: int) -> Machine:
    """The default machine with one slice of `sram_bytes` (as tests/test_simulator.py's tiny machine)."""
    return replace(default_machine(), name="tiny", clusters=1, slices=1, sram_bytes_per_slice=sram_bytes)


def long_program_case(ops: int, sram_bytes: int | None, policy: str = "spill", **kw: Any) -> Callable[[], SimReport]:
    def run() -> SimReport:
        module = scale.parse_program(scale.long_program(ops, **kw))
        machine = default_machine() if sram_bytes is None else small_sram(sram_bytes)
        return simulate_module.simulate(module, "f", [scale.program_input()], machine, sram_policy=policy).report
    return run


def model_case(name: str, tokens: int) -> Callable[[], SimReport]:
    def run() -> SimReport:
        model = next(m for m in MODELS if m.name == name)
        program = tcpc.compile_file(model.path, dims={**model.dims, "T": tokens, "B": 4})  # the block pinned
        return program.simulate(cost_only=True, routing="skewed").report
    return run


CASES: dict[str, Callable[[], SimReport]] = {
    "chain 300, roomy": long_program_case(300, None),
    "chain 300, 4 KB": long_program_case(300, 4096),
    "chain 300, 3 KB, wide window": long_program_case(300, 3072, window=32, far=0.2, seed=1),
    "chain 300, 2.5 KB (streams)": long_program_case(300, 2560, seed=2),
    "chain 300, 1.5 KB (streams)": long_program_case(300, 1536, seed=3),
    "chain 300, 768 B (fused, refetch)": long_program_case(300, 768, seed=4),
    "chain 1500, 4 KB": long_program_case(1500, 4096, seed=5),
    "mixtral T=64": model_case("mixtral", 64),
}

PINNED: dict[str, tuple[tuple[int, ...], str]] = {
    'chain 300, roomy': ((6084, 14336, 11264, 0, 0, 0, 0, 0, 0), '2d800996e86b4022'),
    'chain 300, 4 KB': ((79988, 4096, 4096, 84, 0, 0, 0, 165, 0), '78cbfdba2c27da88'),
    'chain 300, 3 KB, wide window': ((160540, 3072, 3072, 264, 0, 0, 0, 437, 0), 'b02bdaa6af229979'),
    'chain 300, 2.5 KB (streams)': ((92624, 2048, 2048, 160, 231, 30, 0, 430, 0), '1e859f7c6ab8387c'),
    'chain 300, 1.5 KB (streams)': ((178549, 1024, 1024, 67, 392, 158, 0, 617, 0), '15ee0691e100a49c'),
    'chain 300, 768 B (fused, refetch)': ((310678, 0, 0, 0, 539, 294, 6, 846, 13), 'c11ed7b829fa6933'),
    'chain 1500, 4 KB': ((423024, 4096, 4096, 447, 0, 0, 0, 871, 0), 'ba68da7beb9bbe0b'),
    'mixtral T=64': ((2038905, 23319424, 54694632, 0, 0, 0, 0, 0, 0), '33ac071e0d2034c1'),
}
"""Case -> ((total cycles, scheduled peak SRAM, peak in issue order, spills, streams in, out and
fused, commands the plan added, refetches), the digest of the whole plan and report)."""


def plan_digest(plan: MemoryPlan, report: SimReport) -> str:
    """Every decision of the plan, and every slot of the schedule, as one hash."""
    parts: list[Any] = [
        [astuple(t) for t in plan.tasks],
        sorted((k, astuple(e)) for k, e in plan.extra.items()),
        plan.peak_live_bytes, plan.sram_capacity,
        [astuple(s) for s in plan.spills],
        [astuple(s) for s in plan.streams],
        [astuple(r) for r in plan.residencies],
        sorted((k, astuple(c)) for k, c in plan.costs.items()),
        # Not where the repo is, nor what the driver adds (its choices, the loops read from the IR).
        {k: v for k, v in report.to_json().items() if k not in ("machine_file", "choices", "loops")},
    ]
    # Nor where the repo is: the report's source locations name the example by its path.
    text = repr(parts).replace(str(Path(__file__).resolve().parent.parent), "<repo>")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def summarise(case: Callable[[], SimReport], monkeypatch: pytest.MonkeyPatch) -> tuple[tuple[int, ...], str]:
    """Run `case`, keeping the plan the simulator made."""
    plans: list[MemoryPlan] = []
    plan_memory = simulate_module.plan_memory

    def keep(*args: Any, **kw: Any) -> MemoryPlan:
        plans.append(plan_memory(*args, **kw))
        return plans[-1]

    monkeypatch.setattr(simulate_module, "plan_memory", keep)
    report = case()
    plan = plans[-1]  # the run's: a strategy=auto costs (and plans) its candidates first
    refetches = sum(1 for e in plan.extra.values() if e.label.startswith("refetch"))
    streams = [sum(1 for s in plan.streams if s.direction == d) for d in ("in", "out", "fused")]
    numbers = (report.total_cycles, report.peak_sram_bytes, plan.peak_live_bytes, len(plan.spills),
               *streams, len(plan.extra), refetches)
    return numbers, plan_digest(plan, report)


@pytest.mark.parametrize("name", CASES)
def test_the_plan_is_the_pinned_plan(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    numbers, digest = summarise(CASES[name], monkeypatch)
    assert (numbers, digest) == PINNED[name]


def test_the_cases_cover_every_mechanism() -> None:
    """Spills, streams in and out, fused results and refetches all occur among the cases."""
    for column in (3, 4, 5, 6, 8):  # spills, streams in, out, fused, refetches
        assert any(numbers[column] for numbers, _ in PINNED.values())


def test_the_error_policy_stops_where_the_spill_policy_spills() -> None:
    with pytest.raises(SramOverflowError, match=r"SRAM overflow at %v\d+ = .*: it asks for 1,024 bytes, 0 of 4,096"):
        long_program_case(300, 4096, "error")()


def test_a_computing_engine_reads_hbm_through_a_stream() -> None:
    """The contraction and vector engines read SRAM only: without load-arguments, the router's
    ops read the tokens and the router weight where they are, in HBM, and each such read is
    streamed in before its command (costed, in the report's streams), never free; with it,
    none is."""
    from runtime_sim.perf.cost_only import simulate_cost_only

    program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / "mixtral.moe", dims={"T": 64, "B": 4})
    name = program.function().sym_name.data
    partial = "pin-routing,lower-topk,lower-routing,lower-dispatch,lower-math"
    report = simulate_cost_only(program.lower(partial), name, routing="balanced").report
    reads = {s.buffer: s for s in report.streams if s.direction == "read"}
    d = program.dims["D"]
    assert reads["%x"].bytes == 64 * d * 2 and reads["%x"].op == "ve.widen"
    assert "%router" in reads and not [s for s in report.streams if s.direction != "read"]
    by_label = {o.label: o for o in report.ops}
    assert by_label["stream in %x"].end <= by_label["ve.widen"].start
    assert "streamed %x (8,192 B) in from HBM for ve.widen, which reads SRAM only" in report.to_text()
    loaded = simulate_cost_only(program.lower(partial + ",load-arguments"), name, routing="balanced").report
    assert loaded.streams == []


CROSSING = """
builtin.module {
  func.func @f(%x: tensor<64x128xf32>) -> tensor<64x128xf32> {
    %a = tcp.load %x : tensor<64x128xf32> -> tensor<64x128xf32>
    %b = ve.exp %a : tensor<64x128xf32>
    %c = ve.exp %b : tensor<64x128xf32> {tcpc.cluster = 1 : i64}
    %d = tile.copy %b : tensor<64x128xf32> -> tensor<64x128xf32> {tcpc.cluster = 1 : i64}
    %e = ve.add %c, %d : tensor<64x128xf32> {tcpc.cluster = 1 : i64}
    func.return %e : tensor<64x128xf32>
  }
}
"""


def test_a_computing_engine_reads_another_clusters_sram_through_a_copy() -> None:
    """A cluster's engines read its own SRAM only (the book, Fetch Engine): %c, on cluster 1,
    reads %b, made on cluster 0, so the plan copies %b over first (a DMA copy costed as the
    `tile.copy` %d of the same bytes), listed with the streams; %e reads cluster 1's own %c and
    %d and needs none. Each cluster's buffers sit in its own SRAM."""
    report = tcpc.load_ir(CROSSING).simulate().report
    assert [(s.buffer, s.bytes, s.op, s.direction) for s in report.streams] == [("%b", 32768, "%c = ve.exp", "cluster")]
    by_label = {o.label: o for o in report.ops}
    copy = by_label["copy %b from cluster 0"]
    assert copy.engine == "dma" and copy.cycles == by_label["%d = tile.copy"].cycles
    assert by_label["%b = ve.exp"].end <= copy.start and copy.end <= by_label["%c = ve.exp"].start
    assert report.cluster_peak_sram_bytes == [2 * 32768, 3 * 32768]  # %a, %b; %c, %d, %e
    assert "streamed %b (32,768 B) from another cluster's SRAM for %c = ve.exp, which reads its own cluster's" in report.to_text()


DMA_ONLY = """
builtin.module {
  func.func @f(%x: tensor<64x128xf32>, %y: tensor<96x128xf32>) -> (tensor<64x128xf32>, tensor<96x128xf32>) {
    %a = tcp.load %x : tensor<64x128xf32> -> tensor<64x128xf32>
    %c = ve.exp %a : tensor<64x128xf32>
    %b = tcp.load %y : tensor<96x128xf32> -> tensor<96x128xf32>
    %s = tcp.store %b : tensor<96x128xf32> -> tensor<96x128xf32>
    %e = ve.add %a, %c : tensor<64x128xf32>
    func.return %e, %s : tensor<64x128xf32>, tensor<96x128xf32>
  }
}
"""


def test_a_buffer_only_dma_touches_may_live_in_the_other_cluster() -> None:
    """Two clusters of 96 KB: %b (48 KB), loaded and stored by DMA only, does not fit beside
    cluster 0's %a and %c, and a DMA engine reaches every cluster's SRAM, so it goes to
    cluster 1's rather than overflowing (the `error` policy would stop) or spilling; %e, on
    cluster 0's engines, fits there once %b is elsewhere."""
    machine = replace(default_machine(), name="two-small", slices=1, sram_bytes_per_slice=96 * 1024)
    report = tcpc.load_ir(DMA_ONLY).simulate(machine=machine, sram_policy="error").report
    assert report.cluster_peak_sram_bytes == [3 * 32768, 49152] and not report.spills and not report.streams


def _link_reader_trace(collective: str) -> tuple[Trace, int]:
    """A collective reading buffer 0 on the link, a load issued while it runs, then a reader of
    both results; with its done for an all-to-all start. The trace and its buffers' size."""
    from runtime_sim.perf.cost_model import DMA, LINK, NONE, TENSOR, OpCost

    ops = [TracedOp(0, "tcp.load", "%x = tcp.load", OpCost(DMA, 10), writes=(0,)),
           TracedOp(1, collective, f"%recv = {collective}", OpCost(LINK, 1000), (0,), (0,), (1,)),
           TracedOp(2, "tcp.load", "%w = tcp.load", OpCost(DMA, 10), writes=(2,))]
    if collective == "ccl.all_to_all_start":
        ops.append(TracedOp(3, "ccl.all_to_all_done", "%got = ccl.all_to_all_done", OpCost(NONE, 0), (1,), (1,)))
        ops.append(TracedOp(4, "ve.add", "%y = ve.add", OpCost(TENSOR, 10), (2, 3), (1, 2), (3,)))
    else:
        ops.append(TracedOp(3, "ve.add", "%y = ve.add", OpCost(TENSOR, 10), (1, 2), (1, 2), (3,)))
    size = 4096
    return Trace(ops=ops, buffer_bytes={b: size for b in range(4)},
                 buffer_labels={b: f"#{b}" for b in range(4)}, outputs={3}), size


@pytest.mark.parametrize("collective, roomy_buffers", [("ccl.all_to_all_start", 3), ("ccl.all_gather", 4)])
def test_a_collectives_operands_live_while_the_link_reads_them(collective: str, roomy_buffers: int) -> None:
    """The link reads a `ccl.all_to_all_start`'s operands until the transfer ends, which its
    `ccl.all_to_all_done` marks, and a collective without a done's (sp's all-gather of the next
    chunk's rows, issued before this chunk's experts) until the first command that reads its
    result: their space is not free in between. A load issued between (the next chunk's experts
    under the dispatch) takes other space, not the operands' with a wait for the link (64 chips
    of DeepSeek-V3, ep=8,sp=8 prefill: cluster 0's experts idled 200 us), and with no other
    space the `error` policy stops there."""
    from runtime_sim.perf.memory_plan import plan_memory

    trace, size = _link_reader_trace(collective)
    roomy = plan_memory(trace, small_sram(roomy_buffers * size))
    assert {t.key: t.after for t in roomy.tasks}[2] == () and not roomy.spills
    with pytest.raises(SramOverflowError, match="%w = tcp.load"):
        plan_memory(trace, small_sram(2 * size), "error")


# --- free space ---------------------------------------------------------------------------------


def test_free_space_is_claimed_never_used_first_then_freed_earliest() -> None:
    free = FreeSpace(100)
    assert free.take(60) == [] and free.bytes == 40
    free.add(30, (7, 9))
    free.add(30, (3, 4))
    assert free.bytes == 100
    assert free.take(50) == [3, 4]  # the 40 never-used bytes, then 10 of the piece freed after 4
    assert free.take(20) == [3, 4]  # the rest of that piece
    assert free.take(25) == [7, 9]
    assert free.bytes == 5


def test_a_cluster_claims_its_own_memory_only() -> None:
    """Two clusters of 50 bytes each: cluster 1 takes its never-used space, then its own freed
    piece (though cluster 0's was freed earlier in issue order), and never cluster 0's: its
    engines read and write their own cluster's SRAM only (the book, Fetch Engine)."""
    free = FreeSpace(100, clusters=2)
    assert free.take(50, cluster=0) == [] and free.take(40, cluster=1) == []
    free.add(30, (3,), cluster=0)
    free.add(20, (8,), cluster=1)
    assert free.free == [30, 30] and free.bytes == 60
    assert free.take(10, cluster=1) == []  # the last never-used bytes of cluster 1
    assert free.take(15, cluster=1) == [8]  # its own piece freed after 8, not 0's after 3
    with pytest.raises(AssertionError, match="claiming 20 of 5 free bytes"):
        free.take(20, cluster=1)  # cluster 0's 30 free bytes are not cluster 1's
    assert free.take(30, cluster=0) == [3] and free.free == [0, 5]


def test_free_space_merges_pieces_with_the_same_commands_to_wait_for() -> None:
    free = FreeSpace(0)
    free.add(10, (2,))
    free.add(10, (2,))
    free.add(5, (1, 2))
    assert free.take(5) == [1, 2]  # the same last command as (2,): ties go by the whole tuple
    assert free.take(20) == [2]  # one merged piece: waited for once
    assert free.bytes == 0
    with pytest.raises(AssertionError, match="claiming 1 of 0 free bytes"):
        free.take(1)


def test_an_empty_piece_in_the_way_is_used_up_with_its_commands() -> None:
    free = FreeSpace(0)
    free.add(0, (1,))
    free.add(8, (2,))
    assert free.take(4) == [1, 2]
    assert free.take(0) == []


# --- scale -----------------------------------------------------------------------------------------


def test_a_program_of_thousands_of_ops_simulates_under_pressure() -> None:
    """2,000 ops on cluster 0's 4 KB of SRAM: the planner spills hundreds of buffers, and the run
    computes what the unconstrained run does, never holds more than SRAM, and its critical
    path is a tight chain of commands."""
    module = scale.parse_program(scale.long_program(2000))
    roomy = scale.simulate_program(module, default_machine())
    tight = scale.simulate_program(module, scale.tight_machine())
    np.testing.assert_array_equal(tight.outputs[0], roomy.outputs[0])
    r = tight.report
    assert len(r.spills) > 400 and not r.streams
    assert len(r.ops) == 2000 + sum(1 for o in r.ops if o.label.startswith(("spill ", "reload ")))
    assert r.peak_sram_bytes <= r.machine.cluster_sram_bytes == scale.TIGHT_SRAM_BYTES  # all on cluster 0
    assert r.total_cycles > roomy.report.total_cycles >= roomy.report.roofline.cycles
    assert sum(r.op(k).cycles for k in r.critical_path) == r.total_cycles
    assert r.op(r.critical_path[-1]).end == r.total_cycles



def test_the_scale_benchmark_prints_a_row_per_length(capsys: pytest.CaptureFixture[str]) -> None:
    scale.main(["--ops", "120", "240"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| ops | roomy: commands | roomy: seconds | tight: commands | tight: spills |")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert [r[0] for r in rows] == ["120", "240"]
    for ops, roomy, _, tight, spills, _ in rows:
        assert roomy == ops and int(tight) > int(ops) and int(spills) > 0



def test_the_simulator_doc_scale_table_counts_what_the_benchmark_counts() -> None:
    """docs/simulator.md's commands and spills at 1,000 ops are benchmarks/scale.py's (seconds vary)."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "simulator.md").read_text()
    line = next(line for line in doc.splitlines() if line.startswith("| 1,000 | "))
    ops, roomy, _, tight, spills, _ = [cell.strip() for cell in line.strip("|").split("|")]
    row = scale.measure(1000)
    assert [ops, roomy, tight, spills] == [f"{n:,}" for n in (row.ops, row.roomy_commands, row.tight_commands,
                                                              row.tight_spills)]


if __name__ == "__main__":  # print PINNED for the current code
    for name, case in CASES.items():
        with pytest.MonkeyPatch.context() as patch:
            print(f"    {name!r}: {summarise(case, patch)!r},")


STORE_CROSSING = """
builtin.module {
  func.func @f(%x: tensor<64x128xf32>) -> tensor<128x128xf32> {
    %i0 = arith.constant 0 : index
    %i1 = arith.constant 64 : index
    %buf = tile.buffer "sram" : tensor<128x128xf32>
    %a = tcp.load %x : tensor<64x128xf32> -> tensor<64x128xf32>
    %a1 = tcp.load %x : tensor<64x128xf32> -> tensor<64x128xf32> {tcpc.cluster = 1 : i64}
    %b = ve.exp %a : tensor<64x128xf32>
    %c = ve.exp %a1 : tensor<64x128xf32> {tcpc.cluster = 1 : i64}
    %s0 = tile.store %b, %buf[%i0] : tensor<64x128xf32>, tensor<128x128xf32> -> tensor<128x128xf32>
    %s1 = tile.store %c, %s0[%i1] : tensor<64x128xf32>, tensor<128x128xf32> -> tensor<128x128xf32> {tcpc.cluster = 1 : i64}
    %d = tile.copy %c : tensor<64x128xf32> -> tensor<64x128xf32> {tcpc.cluster = 1 : i64}
    %f = ve.exp %s1 : tensor<128x128xf32>
    %e = tcp.store %f : tensor<128x128xf32> -> tensor<128x128xf32>
    func.return %e : tensor<128x128xf32>
  }
}
"""


def test_a_store_into_another_clusters_sram_is_a_dma_copy() -> None:
    """An engine writes its own cluster's SRAM only (data between clusters moves by DMA): %s0
    commits cluster 0's %b into cluster 0's %buf in place, free, but %s1 stores cluster 1's %c
    into it, and cluster 0's %f reads it, so the plan copies %c's bytes over first (a DMA copy
    costed as the `tile.copy` %d of the same bytes), listed with the streams; the store's
    readers wait for the copy. Read by DMA alone (a DMA engine reaches every cluster's SRAM),
    the rows each cluster stores stay in its own SRAM: no copy (a mesh receiver's partial
    sums, stored by both clusters and sent by the link)."""
    dma_only = STORE_CROSSING.replace("%f = ve.exp %s1 : tensor<128x128xf32>",
                                      "%f = tile.copy %s1 : tensor<128x128xf32> -> tensor<128x128xf32>")
    assert tcpc.load_ir(dma_only).simulate().report.streams == []
    report = tcpc.load_ir(STORE_CROSSING).simulate().report
    assert [(s.buffer, s.bytes, s.op, s.direction) for s in report.streams] == [("%buf", 32768, "%s1 = tile.store", "store")]
    by_label = {o.label: o for o in report.ops}
    copy = by_label["store into %buf on cluster 0"]
    assert copy.engine == "dma" and copy.cycles == by_label["%d = tile.copy"].cycles
    assert by_label["%c = ve.exp"].end <= copy.start and copy.end <= by_label["%f = ve.exp"].start
    assert "streamed %buf (32,768 B) into another cluster's SRAM by %s1 = tile.store" in report.to_text()
