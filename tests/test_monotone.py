"""Monotone simulated time (issue #12): more tokens never give fewer cycles, a bigger machine
never more.

The layer and the sweeps are benchmarks/monotone.py's (issue #12's Mixtral-style layer, cost-only,
balanced routing). The suite runs the steps of its T sweep that once went the wrong way, each
for a cause that is now fixed by construction, and a few machine steps; the benchmark runs the
whole sweep (T from 128 to 1024 in steps of 8, SRAM and HBM upward):

- T 256 -> 264 and 512 -> 520: when T*K/E fills whole blocks, G counts dozens of unused
  blocks, which paid their row loads, stores and vector work at the end of the expert loop
  (schedule-experts now skips an unused block whole, behind its `tile.guard`);
- T 1016 -> 1024: the token load crossed 2 MB, which the old DMA split rule (an even split over
  floor(bytes / split_bytes) engines) made twice as fast as 2 MB - 1 B (the split now cuts
  pieces of split_bytes, `tcp_cost.largest_part_requests`, never decreasing in the bytes);
- T 360 -> 368: the router's token work fitted SRAM whole at 360 and ran on one cluster, and
  at 368 needed two tiles, which ran on both clusters, faster (schedule-tokens now cuts a phase
  that makes >= 8 MB of vector results into a tile per cluster, and balances its tiles);
- list scheduling: the scheduler took the DMA engine that freed first, so a weight load waiting
  for its inputs took an engine idle since long ago and a row load ready earlier queued behind
  it (at T = 776 the expert loop slowed by a sixth); it now takes the best fit, which gives every
  command the same start and leaves the long-idle engines to later commands. List scheduling
  is not monotone by construction in general (Graham's anomalies): the sweeps check it;
- T 720 -> 728 (and 616 -> 624, 688 -> 696, 760 -> 768, three blocks per expert): a block
  reusing the previous block's weights ran its `tile.load_expert` guard on a DMA engine only
  once the previous tile had arrived, and the next expert's 1 MB load, issued after it,
  queued behind it there, so two loads ran in turn on one engine however the blocks fell (the
  reused tile is now passed through: the guard waits for nothing, its readers wait for the
  load, tile_cost.py);
- T 448 -> 456 (two blocks per expert; it fell by 0.7% once, and by 1.3% with the reused
  tile passed through): a block's row gather waited for block g - 2's contraction, holding a
  DMA engine idle while weight loads queued behind it (11% of the engines' time in the expert
  loop at T = 448), and which gathers held which engines depended on how the blocks fell (row
  tiles are now fetched four blocks ahead, schedule-experts' ROWS_AHEAD);
- T 280 -> 288 (7 cycles): the first blocks' weight loads were issued as soon as the expert
  ids were known and shared the DMA engines with the dispatch's scatters in an order that
  changed with T, and the loop, bound by its loads, ended a few cycles earlier at 288 (a
  weight load now waits for the dispatch's row indices too: the loop starts from the dispatch);
- T 984 -> 992 and 1008 -> 1016, once the loop started from the dispatch (by 33 and 8
  cycles): the routing's chunked cumsum took the largest divisor of P below sqrt(P) as its
  chunk count, which at P = 8064 meant three rounds of the vector engine's rows against two at
  P = 8128 (lower-routing now takes the divisor with the fewest scan steps).
"""

from __future__ import annotations

import pytest
from benchmark_scripts import load_script
from hypothesis import given, settings
from hypothesis import strategies as st

from target.machine import default_machine
from runtime_sim.perf.scheduler import Task, schedule
from runtime_sim.perf.tcp_cost import dma_copy_cost, dma_parts

monotone = load_script("monotone")

TOKEN_STEPS = [(256, 264), (280, 288), (360, 368), (448, 456), (512, 520), (720, 728), (1008, 1016), (1016, 1024)]


@pytest.mark.parametrize("fewer, more", TOKEN_STEPS, ids=[f"T{a}-T{b}" for a, b in TOKEN_STEPS])
def test_more_tokens_never_take_fewer_cycles(fewer: int, more: int) -> None:
    assert monotone.cycles(fewer) <= monotone.cycles(more)


MACHINE_TOKENS = 128
"""Fewer tokens than the benchmark's machine sweeps (T = 256), to keep the suite fast."""
SRAM_STEPS = [(96, 512)]
HBM_STEPS = [(400, 1500), (1500, 3000)]


@pytest.mark.parametrize("smaller, larger", SRAM_STEPS, ids=[f"{a}KB-{b}KB" for a, b in SRAM_STEPS])
def test_more_sram_never_takes_more_cycles(smaller: int, larger: int) -> None:
    t = MACHINE_TOKENS
    assert monotone.cycles(t, monotone.with_sram(larger)) <= monotone.cycles(t, monotone.with_sram(smaller))


@pytest.mark.parametrize("slower, faster", HBM_STEPS, ids=[f"{a}-{b}GBps" for a, b in HBM_STEPS])
def test_more_hbm_bandwidth_never_takes_more_cycles(slower: int, faster: int) -> None:
    t = MACHINE_TOKENS
    assert monotone.cycles(t, monotone.with_hbm(faster)) <= monotone.cycles(t, monotone.with_hbm(slower))


@settings(max_examples=300, deadline=None)
@given(nbytes=st.integers(1, 20 << 20), more=st.integers(1, 3 << 20),
       src=st.booleans(), dst=st.booleans(), hbm_gb=st.sampled_from([100, 400, 1500]))
def test_a_larger_dma_copy_is_never_faster(nbytes: int, more: int, src: bool, dst: bool, hbm_gb: int) -> None:
    """The split rule by construction: the largest part never shrinks as the bytes grow, on a
    machine where HBM binds and on one where it does not."""
    machine = monotone.with_hbm(hbm_gb)
    small, large = dma_copy_cost(machine, nbytes, src, dst), dma_copy_cost(machine, nbytes + more, src, dst)
    assert small.cycles <= large.cycles
    assert small.parts <= large.parts <= machine.dma_engines


def test_the_split_cuts_pieces_of_split_bytes() -> None:
    """1.5 MB runs as 1 MB + 0.5 MB on two engines: the time of the 1 MB piece."""
    m = default_machine()
    split = m.dma_split_bytes
    assert dma_parts(m, split) == 1 and dma_parts(m, split + 1) == 2 and dma_parts(m, 3 * split // 2) == 2
    assert dma_copy_cost(m, 3 * split // 2, True, False).cycles == dma_copy_cost(m, split, True, False).cycles
    assert dma_copy_cost(m, 9 * split, True, False).parts == m.dma_engines


def test_a_waiting_command_leaves_the_long_idle_unit_to_a_ready_one() -> None:
    """Two units: unit 0 runs a command until 10, unit 1 is idle from 0. A command that cannot
    start before 100 takes unit 0 (the best fit: it became free last); the next one, ready at
    0, starts at 0 on unit 1. Taking the unit that freed first would have put the waiting
    command on unit 1 and the ready one after unit 0's 10 cycles."""
    tasks = [Task(0, "busy", "dma", 10), Task(1, "producer", "tensor", 100),
             Task(2, "waits", "dma", 50, deps=(1,)), Task(3, "ready", "dma", 5)]
    slots = schedule(tasks, {"dma": 2, "tensor": 1}).slots
    assert (slots[0].unit, slots[0].end) == (0, 10)
    assert (slots[2].unit, slots[2].start) == (0, 100)
    assert (slots[3].unit, slots[3].start) == (1, 0)
