"""Numpy semantics of the `moe` ops: the reference for top-k order and the canonical block layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from xdsl.interpreter import Interpreter, InterpreterFunctions, impl, register_impls
from xdsl.utils.exceptions import InterpretationError

from dialects import moe
from runtime_sim.semantics.numerics import compute, contract, round_to, tensor_dtype
from runtime_sim.semantics.quantization import scaled_contract


def topk_indices(x: np.ndarray, k: int, order: str = "score") -> np.ndarray:
    """Indices of the k largest values along the last axis, as i32 (the top-k order of
    docs/architecture.md#top-k-order).

    Sort key, most significant first: NaN after every number; larger value first (-0.0 and
    +0.0 are equal); lower index first.
    """
    values = compute(x).astype(np.float64)  # i32 values are exact in f64, and -i32 never overflows
    is_nan = np.isnan(values)
    neg_value = np.where(is_nan, 0.0, -values)
    index = np.broadcast_to(np.arange(x.shape[-1]), x.shape)
    ranked = np.lexsort((index, neg_value, is_nan), axis=-1)[..., :k]
    if order == "index":
        ranked = np.sort(ranked, axis=-1)
    return ranked.astype(np.int32)


@dataclass(frozen=True)
class RoutePlan:
    """The runtime value of a `!moe.route`: where each pair went and which expert owns each block.

    scatter_idx[t, k] is the row (block * B + position) of pair (t, k) in the blocked buffer, or
    -1 when the pair was dropped by the capacity; expert_ids[g] is block g's expert, -1 if unused.
    """

    scatter_idx: np.ndarray
    expert_ids: np.ndarray
    block: int

    @property
    def row_valid(self) -> np.ndarray:
        """[G * B] booleans: which rows of the blocked buffer hold a pair (the rest are padding)."""
        valid = np.zeros(self.expert_ids.shape[0] * self.block, dtype=np.bool_)
        kept = self.scatter_idx[self.scatter_idx >= 0]
        valid[kept] = True
        return valid


def route_plan(expert_idx: np.ndarray, route: moe.RouteType) -> RoutePlan:
    """The canonical block layout.

    Pairs p = t*K + k in token-major order. Experts in ascending order each own
    ceil(kept_e / B) consecutive blocks; within an expert, pairs keep token-major order. With a
    capacity C, an expert keeps its first C pairs in that order (later tokens drop first, and a
    token's choices drop in k order); dropped pairs get scatter_idx -1.

    Each token's K experts must be distinct and in [0, E), as topk gives them: G is the worst
    case over such routings only, so anything else is an execution error. The one exception is
    -1, a pair routed to no expert (what a chip of a sharded layer sees for another chip's
    experts): it is dropped (scatter_idx -1) and counts for no expert, as the lowered routing
    treats it.
    """
    experts, block, blocks = route.experts.data, route.block.data, route.blocks.data
    flat = expert_idx.reshape(-1).astype(np.int64)
    if flat.size and (flat.min() < -1 or flat.max() >= experts):
        bad = int(flat.min() if flat.min() < -1 else flat.max())
        raise InterpretationError(f"moe.scatter: expert index {bad} is outside [0, {experts})")
    ordered = np.sort(expert_idx.astype(np.int64), axis=-1)
    repeats = np.nonzero(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(axis=-1))[0]
    if repeats.size:
        t = int(repeats[0])
        row = ordered[t]
        twice = int(row[1:][row[1:] == row[:-1]][0])
        raise InterpretationError(
            f"moe.scatter: token {t} chooses expert {twice} more than once "
            "(a token's K experts must be distinct)"
        )
    routed = flat >= 0  # -1: the pair goes to no expert (another chip's, after sharding)
    expert = np.maximum(flat, 0)
    one_hot = (flat[:, None] == np.arange(experts))
    position = (np.cumsum(one_hot, axis=0) - 1)[np.arange(flat.size), expert]
    capacity = route.capacity_limit
    kept = routed & (position < capacity if capacity is not None else True)
    kept_counts = np.bincount(expert[kept], minlength=experts)
    blocks_per_expert = -(-kept_counts // block)
    first_block = np.cumsum(blocks_per_expert) - blocks_per_expert
    scatter_idx = np.where(kept, first_block[expert] * block + position, -1)
    used = int(blocks_per_expert.sum())
    assert used <= blocks, f"routing needs {used} blocks, more than the worst case {blocks}"
    expert_ids = np.full(blocks, -1, dtype=np.int32)
    expert_ids[:used] = np.repeat(np.arange(experts), blocks_per_expert)
    return RoutePlan(scatter_idx.reshape(expert_idx.shape).astype(np.int32), expert_ids, block)


def dispatch(x: np.ndarray, plan: RoutePlan) -> np.ndarray:
    """Tokens [T, D] into zeroed blocks [G, B, D]: pair (t, k) copies row t to scatter_idx[t, k]."""
    g, b = plan.expert_ids.shape[0], plan.block
    blocked = np.zeros((g * b, x.shape[1]), dtype=x.dtype)
    pairs = plan.scatter_idx.reshape(-1)
    tokens = np.repeat(np.arange(x.shape[0]), plan.scatter_idx.shape[1])
    kept = pairs >= 0
    blocked[pairs[kept]] = x[tokens[kept]]
    return blocked.reshape(g, b, x.shape[1])


@register_impls
class MoEFunctions(InterpreterFunctions):
    @impl(moe.TopKOp)
    def run_topk(self, interpreter: Interpreter, op: moe.TopKOp, args: tuple[Any, ...]):
        x = args[0]
        indices = topk_indices(x, op.k.value.data, op.order_name)
        return np.take_along_axis(x, indices.astype(np.int64), axis=-1), indices

    @impl(moe.ScatterOp)
    def run_scatter(self, interpreter: Interpreter, op: moe.ScatterOp, args: tuple[Any, ...]):
        x, expert_idx = args
        plan = route_plan(expert_idx, op.route.type)
        return dispatch(x, plan), plan

    @impl(moe.RouteOp)
    def run_route(self, interpreter: Interpreter, op: moe.RouteOp, args: tuple[Any, ...]):
        scatter_idx, expert_ids = args
        r = op.route.type
        rows = r.blocks.data * r.block.data
        for name, values, bound in (("scatter_idx", scatter_idx, rows), ("expert_ids", expert_ids, r.experts.data)):
            bad = values[(values < -1) | (values >= bound)]
            if bad.size:
                raise InterpretationError(f"moe.route: {name} entry {int(bad.flat[0])} is outside [-1, {bound})")
        return (RoutePlan(scatter_idx, expert_ids, r.block.data),)

    @impl(moe.PairRowsOp)
    def run_pair_rows(self, interpreter: Interpreter, op: moe.PairRowsOp, args: tuple[Any, ...]):
        (plan,) = args
        return (plan.scatter_idx.astype(np.int32, copy=True),)

    @impl(moe.DispatchOp)
    def run_dispatch(self, interpreter: Interpreter, op: moe.DispatchOp, args: tuple[Any, ...]):
        x, plan = args
        return (dispatch(x, plan),)

    @impl(moe.GroupedMatmulOp)
    def run_grouped_matmul(
        self, interpreter: Interpreter, op: moe.GroupedMatmulOp, args: tuple[Any, ...]
    ):
        x, weight, plan = args[:3]
        bias = args[3] if len(args) > 3 else None
        g, b, f = moe.shape_of(op.result.type)
        out = np.zeros((g, b, f), dtype=np.float32)
        for block, expert in enumerate(plan.expert_ids):
            if expert < 0:
                continue
            out[block] = contract("bd,df->bf", compute(x[block]), compute(weight[expert]))
            if bias is not None:
                out[block] += compute(bias[expert])
        out.reshape(g * b, f)[~plan.row_valid] = 0
        return (round_to(out, tensor_dtype(op.result.type)),)

    @impl(moe.ScaledGroupedMatmulOp)
    def run_scaled_grouped_matmul(
        self, interpreter: Interpreter, op: moe.ScaledGroupedMatmulOp, args: tuple[Any, ...]
    ):
        x, weight, plan, x_scales, w_scales = args[:5]
        bias = args[5] if len(args) > 5 else None
        g, b, f = moe.shape_of(op.result.type)
        out = np.zeros((g, b, f), dtype=np.float32)
        for block, expert in enumerate(plan.expert_ids):
            if expert < 0:
                continue
            out[block] = scaled_contract(x[block:block + 1], x_scales[block:block + 1],
                                         weight[expert:expert + 1], w_scales[expert:expert + 1])[0]
            if bias is not None:
                out[block] += compute(bias[expert])
        out.reshape(g * b, f)[~plan.row_valid] = 0
        return (round_to(out, tensor_dtype(op.result.type)),)

    @impl(moe.CombineOp)
    def run_combine(self, interpreter: Interpreter, op: moe.CombineOp, args: tuple[Any, ...]):
        blocked, plan = args[:2]
        weights = compute(args[2]) if len(args) > 2 else None
        rows = compute(blocked).reshape(-1, blocked.shape[-1])
        t, k = plan.scatter_idx.shape
        out = np.zeros((t, rows.shape[-1]), dtype=np.float32)
        for choice in range(k):
            idx = plan.scatter_idx[:, choice]
            picked = rows[np.maximum(idx, 0)]
            if weights is not None:
                picked = weights[:, choice, None] * picked
            # A dropped pair adds nothing, even where its weight is NaN or inf.
            out += np.where((idx >= 0)[:, None], picked, np.float32(0))
        return (round_to(out, tensor_dtype(op.result.type)),)
