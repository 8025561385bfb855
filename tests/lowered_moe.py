"""A handwritten, fully lowered MoE layer (func, tcp, ve and builtin ops only) for simulator
tests, until the lowering passes produce one.

One expert matmul, y[t] = sum_k gates[t, k] * (x[t] @ w[e_tk]), with the routing given as a
routing argument (`tcpc.routing_experts`, what the pin-routing pass makes) and the canonical
block layout (docs/architecture.md#the-routing-plan-and-the-block-layout) computed on the vector
engine: a one-hot over experts, the pair count per expert (reduce), each pair's rank within its
expert (a cumsum scan), blocks per expert and their cumsum, then each pair's row and each
block's expert id (-1 when unused).
Dispatch is a DMA scatter of token rows into blocks, the weights are gathered per block, the
contraction skips unused blocks by guard, and a DMA gather plus a contraction over K combine.
"""

from __future__ import annotations

from dialects.moe import max_blocks


def moe_ir(t: int, d: int, f: int, e: int, k: int, b: int) -> str:
    assert b & (b - 1) == 0, "the block size must be a power of two (shifts divide by it)"
    s = b.bit_length() - 1
    p = t * k
    g = max_blocks(t, k, e, b)
    rows = g * b
    pe, ge = f"tensor<{p}x{e}xi32>", f"tensor<{g}x{e}xi32>"
    pet, get_ = f"tensor<{p}x{e}xi4>", f"tensor<{g}x{e}xi4>"
    pv, ev, gv = f"tensor<{p}xi32>", f"tensor<{e}xi32>", f"tensor<{g}xi32>"
    tk = f"tensor<{t}x{k}xi32>"
    x, w = f"tensor<{t}x{d}xbf16>", f"tensor<{e}x{d}x{f}xbf16>"
    return f"""
func.func @moe(%x: {x}, %w: {w}, %gates: tensor<{t}x{k}xf32>,
               %routing: {tk} {{tcpc.routing_experts = {e} : i64}}) -> tensor<{t}x{f}xf32> {{
  %pairs = tcp.view %routing : {tk} -> {pv}
  %eb = ve.broadcast %pairs along 1 : {pv} -> {pe}
  %col = ve.iota along 1 : {pe}
  %hit = ve.tag eq %eb, %col : {pe} -> {pet}
  %one = ve.const 1 : {pe}
  %zero = ve.const 0 : {pe}
  %onehot = ve.select %hit in [1], %one, %zero : {pet}, {pe}
  %count = ve.reduce_sum %onehot along 0 : {pe} -> {ev}
  %pos = ve.position_tag along 0 first 0 middle 1 last 2 single 3 : {pet}
  %seen = ve.scan add %onehot, %pos along 0 read [1, 2] write [0, 1] : {pe}, {pet}
  %at = ve.select %hit in [1], %seen, %zero : {pet}, {pe}
  %rank1 = ve.reduce_sum %at along 1 : {pe} -> {pv}
  %onep = ve.const 1 : {pv}
  %rank = ve.sub %rank1, %onep : {pv}
  %bm1 = ve.const {b - 1} : {ev}
  %shift_e = ve.const {s} : {ev}
  %padded = ve.add %count, %bm1 : {ev}
  %nblocks = ve.shr_s %padded, %shift_e : {ev}
  %epos = ve.position_tag along 0 first 0 middle 1 last 2 single 3 : tensor<{e}xi4>
  %bend = ve.scan add %nblocks, %epos along 0 read [1, 2] write [0, 1] : {ev}, tensor<{e}xi4>
  %bstart = ve.sub %bend, %nblocks : {ev}
  %bsb = ve.broadcast %bstart along 0 : {ev} -> {pe}
  %startsel = ve.select %hit in [1], %bsb, %zero : {pet}, {pe}
  %start = ve.reduce_sum %startsel along 1 : {pe} -> {pv}
  %shift_p = ve.const {s} : {pv}
  %row0 = ve.shl %start, %shift_p : {pv}
  %row = ve.add %row0, %rank : {pv}
  %scatter_idx = tcp.view %row : {pv} -> {tk}
  %gi = ve.iota along 0 : {ge}
  %endb = ve.broadcast %bend along 0 : {ev} -> {ge}
  %before = ve.tag le %endb, %gi : {ge} -> {get_}
  %oneg = ve.const 1 : {ge}
  %zerog = ve.const 0 : {ge}
  %beforei = ve.select %before in [1], %oneg, %zerog : {get_}, {ge}
  %eid = ve.reduce_sum %beforei along 1 : {ge} -> {gv}
  %ecount = ve.const {e} : {gv}
  %unused = ve.tag eq %eid, %ecount : {gv} -> tensor<{g}xi4>
  %minus1 = ve.const -1 : {gv}
  %expert_ids = ve.select %unused in [1], %minus1, %eid : tensor<{g}xi4>, {gv}
  %xl = tcp.load %x : {x} -> {x}
  %rows = tcp.dma_scatter %xl[%scatter_idx] : {x}, {tk} -> tensor<{rows}x{d}xbf16>
  %xb = tcp.view %rows : tensor<{rows}x{d}xbf16> -> tensor<{g}x{b}x{d}xbf16>
  %wg = tcp.dma_gather %w[%expert_ids] : {w}, {gv} -> tensor<{g}x{d}x{f}xbf16>
  %y = tcp.contract "gbd,gdf->gbf" %xb, %wg guard %expert_ids : tensor<{g}x{b}x{d}xbf16>, tensor<{g}x{d}x{f}xbf16> guard {gv} -> tensor<{g}x{b}x{f}xbf16>
  %yr = tcp.view %y : tensor<{g}x{b}x{f}xbf16> -> tensor<{rows}x{f}xbf16>
  %back = tcp.dma_gather %yr[%scatter_idx] : tensor<{rows}x{f}xbf16>, {tk} -> tensor<{t}x{k}x{f}xbf16>
  %gl = tcp.load %gates : tensor<{t}x{k}xf32> -> tensor<{t}x{k}xf32>
  %out = tcp.contract "tkf,tk->tf" %back, %gl : tensor<{t}x{k}x{f}xbf16>, tensor<{t}x{k}xf32> -> tensor<{t}x{f}xf32>
  %result = tcp.store %out : tensor<{t}x{f}xf32> -> tensor<{t}x{f}xf32>
  func.return %result : tensor<{t}x{f}xf32>
}}
"""


def moe_source(t: int, d: int, f: int, e: int, k: int, b: int) -> str:
    """The same layer in the .moe language, with the routing as an input: the reference."""
    return f"""
dims T = {t}, D = {d}, F = {f}, E = {e}, K = {k}, B = {b}
graph moe(x: bf16[T, D], w: bf16[E, D, F], gates: f32[T, K], routing: i32[T, K]) -> f32[T, F] {{
    xb, route = scatter(x, routing, experts=E, block=B)
    return combine(f32(grouped_matmul(xb, w, route)), route, gates)
}}
"""
