"""`pin-routing`: each `moe.scatter`'s expert indices become a routing argument of the graph.

For cost-only simulation (runtime_sim/perf/cost_only.py): the [T, K] expert indices a `moe.scatter`
consumes are replaced by a new argument of the function, appended after the others, named
`%routing` (`%routing1`, ... for further scatters) and tagged with the arg attribute
`tcpc.routing_experts = E`. Whoever runs the function then decides the routing (a scenario, or
a file of real top-k indices), and since the lowering passes rewrite ops but never function
signatures, the argument still feeds the routing's index generation after full lowering.

Before:

    func.func @toy(%x: tensor<4x8xbf16>, ...) -> tensor<4x8xbf16> {
      %probs = ...  (the router)
      %top_p, %top_e = moe.topk %probs {k = 2 : i64} : ...
      %xb, %route = moe.scatter %x, %top_e : ... -> ..., !moe.route<T = 4, K = 2, E = 4, B = 2, G = 6>

After:

    func.func @toy(%x: tensor<4x8xbf16>, ..., %routing: tensor<4x2xi32> {tcpc.routing_experts = 4 : i64}) ...
      %top_p, %top_e = moe.topk %probs {k = 2 : i64} : ...
      %routing_ready = tcp.order %routing after %top_e : tensor<4x2xi32>, tensor<4x2xi32>
      %xb, %route = moe.scatter %x, %routing_ready : ... -> ..., !moe.route<T = 4, K = 2, E = 4, B = 2, G = 6>

The router still runs (its values still weight `combine`); its indices no longer decide the
routing, but `tcp.order` keeps them its data dependence: what reads the routing (the index
generation, and on a mesh the collectives that send the ids) waits for the router, as it would
for its indices, and the simulator places the routing in their buffer, at no cost. A scatter
whose indices already are an argument of the graph (a layer that takes its routing as an
input) gets that argument tagged instead; a scatter whose indices already are a routing
argument, ordered or not, is left alone, so the pass is idempotent. Functions that other
functions call are skipped (their signature is a contract).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, FunctionType, IntegerAttr, ModuleOp, i64
from xdsl.ir import BlockArgument
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from dialects import moe, tcp
from dialects.annotations import ROUTING_ATTR, mark, routing_arguments


def _called(module: ModuleOp) -> set[str]:
    return {op.callee.root_reference.data for op in module.walk() if isinstance(op, func.CallOp)}


def _unique_name(block_args: list[BlockArgument], base: str = "routing") -> str:
    taken = {a.name_hint for a in block_args}
    n = 0
    while (name := base if n == 0 else f"{base}{n}") in taken:
        n += 1
    return name


def _tag(fn: func.FuncOp, index: int, experts: int) -> None:
    count = len(fn.function_type.inputs.data)
    attrs = list(fn.arg_attrs.data) if fn.arg_attrs is not None else [DictionaryAttr({})] * count
    attrs += [DictionaryAttr({})] * (count - len(attrs))
    attrs[index] = DictionaryAttr({**attrs[index].data, ROUTING_ATTR: IntegerAttr(experts, i64)})
    fn.arg_attrs = ArrayAttr(attrs)


def pin_function(fn: func.FuncOp) -> int:
    """Pin every scatter of `fn`; returns how many routing arguments it tagged or added."""
    block = fn.body.blocks.first
    if block is None:
        return 0
    pinned = set(routing_arguments(fn))
    changed = 0
    for scatter in [op for op in fn.walk() if isinstance(op, moe.ScatterOp)]:
        idx = scatter.expert_idx
        experts = scatter.route.type.experts.data
        if isinstance(idx.owner, tcp.OrderOp) and isinstance(pin := idx.owner.input, BlockArgument) \
                and pin.block is block and pin.index in pinned:
            continue  # pinned already
        if isinstance(idx, BlockArgument) and idx.block is block:
            if idx.index not in pinned:  # the graph takes its routing as an input: tag that input
                _tag(fn, idx.index, experts)
                pinned.add(idx.index)
                changed += 1
            continue
        arg = block.insert_arg(idx.type, len(block.args))
        arg.name_hint = _unique_name(list(block.args)[:-1])
        order = tcp.OrderOp(arg, idx)
        order.result.name_hint = f"{arg.name_hint}_ready"
        mark([order], "routing")
        Rewriter.insert_op(order, InsertPoint.before(scatter))
        scatter.operands[1] = order.result
        fn.function_type = FunctionType.from_lists([a.type for a in block.args], list(fn.function_type.outputs.data))
        _tag(fn, arg.index, experts)
        pinned.add(arg.index)
        changed += 1
    return changed


@dataclass(frozen=True)
class PinRoutingPass(ModulePass):
    name = "pin-routing"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        called = _called(op)
        for fn in [o for o in op.ops if isinstance(o, func.FuncOp)]:
            if fn.sym_name.data not in called:
                pin_function(fn)
