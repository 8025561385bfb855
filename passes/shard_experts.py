"""shard-experts: the graph-level MoE layer as one SPMD function every chip of a mesh runs.

`shard-experts{ep=8}` (or `dp=2 ep=4`, `strategy=allgather`) rewrites the graph with one
`moe.scatter` into the program of one chip. The mesh's chips split the tokens (T / (dp * ep)
each, the chip's `[T/n, ...]` share of every argument that carries tokens: the scatter's input
and the routing arguments); the ep axis splits the experts (E / ep each: the `[E/ep, ...]` share
of every expert weight and bias); everything else (router, shared expert) is replicated. Every
op on tokens keeps its meaning on the chip's tokens; only the MoE ops change:

`strategy=a2a` (DeepEP; seed 001): `ccl.a2a_plan` gives each (token, choice) pair its slot in a
static per-destination buffer (the chip owning its expert, S slots each, S the exact worst
case `ccl.a2a_slots`); a DMA row scatter packs the tokens; `ccl.all_to_all` sends them (and
each slot's local expert) to the owning chips, which route what they received with an ordinary
`moe.scatter` over their E/ep experts (slots arrive in source-chip order and token-major within
a source, the global token-major order, so a capacity drops exactly what one chip drops), run
the blockwise experts, combine without weights (one row per slot) and send the rows back; the
home chip gathers them by slot and takes the weighted sum over k in order 0..K-1 in f32, as
`moe.combine` does: the result is bit-identical to one chip's.

`strategy=allgather` (seed 000): every chip gathers the group's tokens, expert choices and
weights (`ccl.all_gather`), routes them to its own experts (another chip's expert becomes -1,
a pair `moe.scatter` drops), computes its experts' part of every token's weighted sum in f32,
and `ccl.reduce_scatter` adds the chips' parts in chip order and hands each chip its tokens. The
sum over k is regrouped by chip, so the result may differ from one chip's in the last bit
(within runtime_sim/semantics/tolerance.py's bound).

Errors (PassFailedException): no or several scatters, E or T that the mesh does not divide, a
token tensor whose first axis is reduced, expert weights that are not function arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, ModuleOp, StringAttr, TensorType, f32, i1, i32
from xdsl.ir import Attribute, Block, BlockArgument, Operation, Region, SSAValue
from xdsl.passes import ModulePass
from xdsl.utils.exceptions import PassFailedException

from dialects import ccl, moe, tcp, tmath
from dialects.annotations import PHASE_ATTR, routing_arguments
from dialects.tensor_types import shape_of

STRATEGIES = ("a2a", "allgather")
EP = "ep"


def _fail(message: str) -> PassFailedException:
    return PassFailedException(f"shard-experts: {message}")


def _with_rows(t: Attribute, rows: int) -> Attribute:
    assert isinstance(t, TensorType)
    return TensorType(t.get_element_type(), [rows, *shape_of(t)[1:]])


class _Builder:
    """Ops of the chip's function, in order, and the map from the graph's values to them."""

    def __init__(self, block: Block):
        self.block = block
        self.values: dict[SSAValue, SSAValue] = {}
        self.rows: dict[SSAValue, tuple[int, int]] = {}
        """New value -> (rows in the graph, rows on the chip) of its first axis, for values
        whose first axis is tokens or blocks that the sharding resized."""

    phase: str | None = None
    """The `tcpc.phase` given to the ccl and tcp ops added (dispatch, combine)."""

    def add(self, op: Operation, name: str | None = None) -> Operation:
        if self.phase is not None and op.name.startswith(("ccl.", "tcp.")):
            op.attributes[PHASE_ATTR] = StringAttr(self.phase)
        self.block.add_op(op)
        if name is not None and len(op.results) == 1:
            op.results[0].name_hint = name
        return op

    def value(self, v: SSAValue) -> SSAValue:
        return self.values[v]

    def const(self, value: int | float, element: Attribute) -> SSAValue:
        return self.add(tmath.ConstantOp(value, TensorType(element, []))).results[0]

    def reshape(self, x: SSAValue, shape: list[int], name: str | None = None) -> SSAValue:
        t = TensorType(x.type.get_element_type(), shape)  # type: ignore[attr-defined]
        return self.add(tmath.ReshapeOp(x, t), name).results[0]

    def cast(self, x: SSAValue, element: Attribute, name: str | None = None) -> SSAValue:
        if x.type.get_element_type() == element:  # type: ignore[attr-defined]
            return x
        return self.add(tmath.CastOp(x, TensorType(element, shape_of(x.type))), name).results[0]

    def copy(self, op: Operation) -> None:
        """`op` on the chip's values: a first axis the sharding resized stays resized."""
        if op.regions:
            raise _fail(f"{op.name}: ops with regions are not supported")
        operands = [self.value(v) for v in op.operands]
        resized = {self.rows[v] for v in operands if v in self.rows}
        if len(resized) > 1:
            raise _fail(f"{op.name} mixes tensors resized in different ways")
        types = list(op.result_types)
        change = next(iter(resized), None)
        if change is not None and change[0] != change[1]:
            old, new = change
            types = [_with_rows(t, new) if isinstance(t, TensorType) and shape_of(t)[:1] == (old,) else t
                     for t in types]
            if not any(t != u for t, u in zip(types, op.result_types)) and types:
                raise _fail(f"{op.name} reduces or reshapes away the first axis of a sharded tensor "
                            f"({old} rows in the graph, {new} per chip): it cannot run on a shard")
        new_op = type(op).create(operands=operands, result_types=types, properties=dict(op.properties),
                                 attributes=dict(op.attributes))
        self.add(new_op)
        for old_r, new_r in zip(op.results, new_op.results):
            new_r.name_hint = old_r.name_hint
            self.values[old_r] = new_r
            if change is not None and (new_r.type != old_r.type or change[0] == change[1]):
                self.rows[new_r] = change


@dataclass
class _Layer:
    """The graph's MoE ops and the sizes of the sharding."""

    scatter: moe.ScatterOp
    route: moe.RouteType
    ep: int
    chips: int

    @property
    def tokens(self) -> int:
        return self.route.tokens.data // self.chips

    @property
    def experts_per_chip(self) -> int:
        return self.route.experts.data // self.ep


@dataclass(frozen=True)
class ShardExpertsPass(ModulePass):
    """Shard the MoE layer of every function over a mesh of `dp * ep` chips (see the module
    docstring); `strategy` is `a2a` or `allgather`."""

    name = "shard-experts"

    ep: int = 1
    dp: int = 1
    strategy: str = "a2a"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        if self.strategy not in STRATEGIES:
            raise _fail(f"unknown strategy '{self.strategy}' (expected {', '.join(STRATEGIES)})")
        if self.ep < 1 or self.dp < 1:
            raise _fail(f"ep and dp must be positive (ep={self.ep}, dp={self.dp})")
        for fn in [o for o in op.ops if isinstance(o, func.FuncOp)]:
            if fn.body.blocks.first is not None:
                self._shard(fn)

    def _layer(self, fn: func.FuncOp) -> _Layer:
        scatters = [o for o in fn.walk() if isinstance(o, moe.ScatterOp)]
        if len(scatters) != 1:
            raise _fail(f"@{fn.sym_name.data} has {len(scatters)} moe.scatter ops; sharding needs exactly one")
        scatter = scatters[0]
        route = scatter.route.type
        t, e = route.tokens.data, route.experts.data
        chips = self.dp * self.ep
        if e % self.ep:
            raise _fail(f"E = {e} experts do not divide over ep = {self.ep} chips")
        if t % chips:
            raise _fail(f"T = {t} tokens do not divide over dp * ep = {chips} chips")
        if route.capacity_limit is not None and self.dp > 1:
            raise _fail("a capacity with dp > 1 would drop per data-parallel group, not over all T tokens "
                        "as one chip does; use ep only")
        return _Layer(scatter, route, self.ep, chips)

    def _token_arguments(self, fn: func.FuncOp, layer: _Layer) -> set[int]:
        x = layer.scatter.input
        while not isinstance(x, BlockArgument) and x.owner is not None and len(x.owner.operands) == 1:  # type: ignore[union-attr]
            x = x.owner.operands[0]  # type: ignore[union-attr]
        if not isinstance(x, BlockArgument):
            raise _fail("the tokens scattered to the experts must come from a function argument")
        return {x.index, *routing_arguments(fn)}

    def _expert_arguments(self, fn: func.FuncOp) -> set[int]:
        found: set[int] = set()
        for gm in [o for o in fn.walk() if isinstance(o, moe.GroupedMatmulOp)]:
            for v in (gm.weight, gm.bias):
                if v is None:
                    continue
                if not isinstance(v, BlockArgument):
                    raise _fail("expert weights and biases must be function arguments (each chip holds its own)")
                found.add(v.index)
        return found

    def _shard(self, fn: func.FuncOp) -> None:
        layer = self._layer(fn)
        old_block = fn.body.blocks.first
        assert old_block is not None
        tokens = self._token_arguments(fn, layer)
        experts = self._expert_arguments(fn)
        t, tl = layer.route.tokens.data, layer.tokens
        el = layer.experts_per_chip
        arg_types = []
        for a in old_block.args:
            if a.index in experts:
                arg_types.append(_with_rows(a.type, el))
            elif a.index in tokens:
                arg_types.append(_with_rows(a.type, tl))
            else:
                arg_types.append(a.type)
        block = Block(arg_types=arg_types)
        b = _Builder(block)
        for old, new in zip(old_block.args, block.args):
            new.name_hint = old.name_hint
            b.values[old] = new
            if old.index in tokens:
                b.rows[new] = (t, tl)
        emit = _A2A(b, layer) if self.strategy == "a2a" else _AllGather(b, layer)
        for op in old_block.ops:
            if op is layer.scatter:
                emit.scatter(op)
            elif isinstance(op, moe.GroupedMatmulOp):
                emit.grouped_matmul(op)
            elif isinstance(op, moe.CombineOp):
                emit.combine(op)
            elif isinstance(op, func.ReturnOp):
                b.add(func.ReturnOp(*[b.value(v) for v in op.operands]))
            else:
                b.copy(op)
        ret = block.last_op
        assert ret is not None
        outputs = [v.type for v in ret.operands]
        new_fn = func.FuncOp.from_region(fn.sym_name.data, arg_types, outputs, Region(block))
        new_fn.arg_attrs = ArrayAttr([
            DictionaryAttr({**(fn.arg_attrs.data[i].data if fn.arg_attrs is not None else {}),
                            **({ccl.SHARD_ATTR: StringAttr(kind)} if kind else {})})
            for i, kind in enumerate("experts" if i in experts else "tokens" if i in tokens else ""
                                     for i in range(len(arg_types)))])
        new_fn.res_attrs = fn.res_attrs
        for key, value in fn.attributes.items():
            if key not in ("sym_name", "function_type", "arg_attrs", "res_attrs"):
                new_fn.attributes[key] = value
        mesh = ccl.Mesh(tuple((a, s) for a, s in (("dp", self.dp), ("ep", self.ep)) if s > 1 or a == "ep"))
        new_fn.attributes[ccl.MESH_ATTR] = StringAttr(str(mesh))
        new_fn.attributes[ccl.STRATEGY_ATTR] = StringAttr(self.strategy)
        parent = fn.parent_block()
        assert parent is not None
        parent.insert_op_before(new_fn, fn)
        parent.erase_op(fn)


class _Strategy:
    def __init__(self, b: _Builder, layer: _Layer):
        self.b = b
        self.layer = layer
        self.route: SSAValue | None = None

    def grouped_matmul(self, op: moe.GroupedMatmulOp) -> None:
        b = self.b
        assert self.route is not None
        bias = b.value(op.bias) if op.bias is not None else None
        new = b.add(moe.GroupedMatmulOp(b.value(op.input), b.value(op.weight), self.route, bias))
        new.results[0].name_hint = op.result.name_hint
        b.values[op.result] = new.results[0]
        b.rows[new.results[0]] = (self.layer.route.blocks.data, shape_of(new.results[0].type)[0])

    def _local_scatter(self, op: moe.ScatterOp, x: SSAValue, local_experts: SSAValue, capacity: int | None) -> None:
        """moe.scatter of what this chip computes over its own E/ep experts."""
        b, r = self.b, self.layer.route
        rows, k = shape_of(local_experts.type)
        route_type = moe.RouteType.make(rows, k, self.layer.experts_per_chip, r.block.data, capacity)
        new = b.add(moe.ScatterOp(x, local_experts, route_type))
        new.results[0].name_hint = op.results[0].name_hint
        new.results[1].name_hint = op.results[1].name_hint
        b.values[op.results[0]] = new.results[0]
        b.rows[new.results[0]] = (r.blocks.data, route_type.blocks.data)
        self.route = new.results[1]
        b.values[op.results[1]] = self.route


class _A2A(_Strategy):
    def scatter(self, op: moe.ScatterOp) -> None:
        b, layer = self.b, self.layer
        b.phase = "dispatch"
        ep, tl, d = layer.ep, layer.tokens, shape_of(op.input.type)[1]
        cap = layer.route.capacity_limit
        x, top_e = b.value(op.input), b.value(op.expert_idx)
        plan = b.add(ccl.A2APlanOp(top_e, EP, ep, layer.route.experts.data, cap))
        for r, name in zip(plan.results, ("slot_rows", "slot_experts", "send_counts")):
            r.name_hint = name
        self.plan = plan
        slots = plan.slots
        rows = b.add(tcp.DmaScatterOp(x, plan.slot_rows, ep * slots), "send_rows").results[0]
        send = b.reshape(rows, [ep, slots, d], "send_x")
        self.recv_counts = b.add(ccl.AllToAllOp(plan.counts, EP, ep), "recv_counts").results[0]
        recv = b.add(ccl.AllToAllOp(send, EP, ep, rows=plan.counts), "recv_x").results[0]
        recv_e = b.add(ccl.AllToAllOp(plan.slot_experts, EP, ep, rows=plan.counts), "recv_experts").results[0]
        recv_rows = b.reshape(recv, [ep * slots, d], "recv_rows")
        column = b.reshape(recv_e, [ep * slots, 1])
        one = b.const(1, i32)
        local = b.add(tmath.SubOp(column, one, TensorType(i32, [ep * slots, 1])), "recv_local_expert").results[0]
        # Each expert receives at most one pair per token of the group: ep * T/n pairs, so
        # this capacity never drops; it makes G the exact worst case (a user capacity is lower).
        group_tokens = ep * tl
        self._local_scatter(op, recv_rows, local, min(cap, group_tokens) if cap is not None else group_tokens)
        b.phase = None

    def combine(self, op: moe.CombineOp) -> None:
        b, layer = self.b, self.layer
        ep, slots, d = layer.ep, self.plan.slots, shape_of(op.result.type)[1]
        tl, k = layer.tokens, layer.route.k.data
        assert self.route is not None
        b.phase = "combine"
        rows = b.add(moe.CombineOp(b.value(op.input), self.route), "expert_rows").results[0]
        back = b.reshape(rows, [ep, slots, d], "send_back")
        returned = b.add(ccl.AllToAllOp(back, EP, ep, rows=self.recv_counts), "returned").results[0]
        flat = b.reshape(returned, [ep * slots, d], "returned_rows")
        picked = b.add(tcp.DmaGatherOp(flat, self.plan.slot_rows), "pair_rows").results[0]
        terms = b.cast(picked, f32, "pair_rows_f32")
        if op.weights is not None:
            w = b.cast(b.value(op.weights), f32, "weights_f32")
            kept = b.add(tmath.CmpOp("ge", self.plan.slot_rows, b.const(0, i32), TensorType(i1, [tl, k])),
                         "pair_kept").results[0]
            w = b.add(tmath.SelectOp(kept, w, b.const(0.0, f32), TensorType(f32, [tl, k])), "weights_kept").results[0]
            w3 = b.reshape(w, [tl, k, 1])
            terms = b.add(tmath.MulOp(w3, terms, TensorType(f32, [tl, k, d])), "weighted").results[0]
        total = b.add(tmath.ReduceSumOp(terms, [1], False, TensorType(f32, [tl, d])), "pair_sum").results[0]
        total = b.add(tmath.AddOp(total, b.const(0.0, f32), TensorType(f32, [tl, d]))).results[0]
        out = b.cast(total, op.result.type.get_element_type(), op.result.name_hint)
        b.values[op.result] = out
        b.rows[out] = (layer.route.tokens.data, tl)
        b.phase = None


class _AllGather(_Strategy):
    def scatter(self, op: moe.ScatterOp) -> None:
        b, layer = self.b, self.layer
        b.phase = "dispatch"
        ep, el = layer.ep, layer.experts_per_chip
        x, top_e = b.value(op.input), b.value(op.expert_idx)
        x_all = b.add(ccl.AllGatherOp(x, EP, ep), "x_all").results[0]
        e_all = b.add(ccl.AllGatherOp(top_e, EP, ep), "experts_all").results[0]
        shape = shape_of(e_all.type)
        chip = b.add(ccl.ChipIdOp(EP, ep), "chip").results[0]
        first = b.add(tmath.MulOp(chip, b.const(el, i32), TensorType(i32, [])), "first_expert").results[0]
        local = b.add(tmath.SubOp(e_all, first, TensorType(i32, shape)), "local_expert").results[0]
        bools = TensorType(i1, shape)
        mine = b.add(tmath.CmpOp("ge", local, b.const(0, i32), bools)).results[0]
        local = b.add(tmath.SelectOp(mine, local, b.const(-1, i32), TensorType(i32, shape))).results[0]
        below = b.add(tmath.CmpOp("lt", local, b.const(el, i32), bools)).results[0]
        local = b.add(tmath.SelectOp(below, local, b.const(-1, i32), TensorType(i32, shape)), "mine").results[0]
        self._local_scatter(op, x_all, local, layer.route.capacity_limit)
        b.phase = None

    def combine(self, op: moe.CombineOp) -> None:
        b, layer = self.b, self.layer
        assert self.route is not None
        b.phase = "combine"
        yb = b.cast(b.value(op.input), f32, "expert_rows_f32")
        weights = None
        if op.weights is not None:
            weights = b.add(ccl.AllGatherOp(b.value(op.weights), EP, layer.ep), "weights_all").results[0]
        part = b.add(moe.CombineOp(yb, self.route, weights), "partial").results[0]
        total = b.add(ccl.ReduceScatterOp(part, EP, layer.ep), "summed").results[0]
        out = b.cast(total, op.result.type.get_element_type(), op.result.name_hint)
        b.values[op.result] = out
        b.rows[out] = (layer.route.tokens.data, layer.tokens)
        b.phase = None
