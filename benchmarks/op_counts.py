"""The work tables of lower-topk and lower-routing sections of docs/passes.md, counted from the IR.

    python benchmarks/op_counts.py

Counts the `ve` ops a pass emits (without `ve.const`, `ve.iota` and `ve.position_tag`: static
tables, not work) and the elements they write (the product of each result's shape), for one
top-k token row under both strategies and for one scatter's index generation.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tcpc  # noqa: E402
from dialects.tmath import shape_of  # noqa: E402

STATIC = {"ve.const", "ve.iota", "ve.position_tag"}


def work(module) -> tuple[int, int, list[int]]:  # type: ignore[no-untyped-def]
    """(ops, elements written, the scan length of every ve.scan) of the ve ops in `module`."""
    ops = [op for op in module.walk() if op.name.startswith("ve.") and op.name not in STATIC]
    elements = sum(math.prod(shape_of(op.results[0].type)) for op in ops)
    scans = [shape_of(op.input.type)[op.axis.value.data] for op in ops if op.name == "ve.scan"]
    return len(ops), elements, scans


def topk_row(experts: int, k: int, dtype: str, order: str, strategy: str) -> tuple[int, int]:
    source = f"""graph g(s: {dtype}[1, {experts}]) -> ({dtype}[1, {k}], i32[1, {k}]) {{
        v, i = topk(s, {k}, order="{order}")
        return v, i
    }}"""
    ops, elements, _ = work(tcpc.compile_source(source).lower(f"lower-topk{{strategy={strategy}}}"))
    return ops, elements


def scatter(tokens: int, k: int, experts: int, block: int, capacity: int | None) -> tuple[int, int, int, list[int]]:
    cap = "" if capacity is None else f", capacity={capacity}"
    source = f"""graph g(x: bf16[{tokens}, 1], e: i32[{tokens}, {k}]) -> bf16[{tokens}, 1] {{
        xb, route = scatter(x, e, experts={experts}, block={block}{cap})
        return combine(xb, route)
    }}"""
    program = tcpc.compile_source(source)
    blocks = next(op for op in program.module.walk() if op.name == "moe.scatter").route.type.blocks.data
    ops, elements, scans = work(program.lower("lower-routing"))
    return blocks, ops, elements, scans


def main() -> None:
    print("lower-topk, one token row: ops / elements")
    print("| E | K | scores | order | rank: ops / elements | rounds: ops / elements |")
    print("|---|---|---|---|---|---|")
    for e, k, dtype, order in [(8, 2, "bf16", "score"), (8, 2, "f32", "score"), (8, 2, "f32", "index"),
                               (128, 8, "bf16", "score"), (128, 8, "f32", "score"),
                               (256, 8, "bf16", "score"), (256, 8, "f32", "score")]:
        rank = topk_row(e, k, dtype, order, "rank")
        rounds = topk_row(e, k, dtype, order, "rounds")
        print(f"| {e} | {k} | {dtype} | {order} | {rank[0]} / {rank[1]} | {rounds[0]} / {rounds[1]} |")
    print()
    print("lower-routing, one scatter")
    print("| T | K | E | B | C | G | ops | elements | scan steps (each scan, in IR order) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t, k, e, b, c in [(16, 2, 8, 4, None), (16, 2, 8, 2, 3), (4096, 2, 8, 64, None),
                          (4096, 8, 128, 64, None), (4096, 8, 256, 64, None)]:
        g, ops, elements, scans = scatter(t, k, e, b, c)
        steps = ", ".join(str(n) for n in scans)
        print(f"| {t} | {k} | {e} | {b} | {'' if c is None else c} | {g} | {ops} | {elements:,} | {steps} |")


if __name__ == "__main__":
    main()
