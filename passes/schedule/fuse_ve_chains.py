"""`fuse-ve-chains`: consecutive `ve` ops that fit the vector engine's stage order run as one
invocation of the chain, grouped into a `ve.chain`.

The chip's vector engine is a fixed chain of optional stages (Tag, Logic, Fxp, ..., Clip,
Filter); one invocation streams the data once through every stage it needs, so a run of ops
whose stages come in that order, each ALU used once, costs one configuration overhead and one
pass over the data instead of one of each per op, and its intermediates never reach SRAM.
Which runs qualify is dialects/ve_stages.py's table and rules (`chain_problem`); this pass
finds maximal ones:

    %s = ve.sigmoid %y : tensor<64xf32>
    %m = ve.mul %s, %g : tensor<64xf32>
    %h = ve.narrow %m : tensor<64xf32> -> tensor<64xbf16>

becomes

    %h = ve.chain (%y_1 = %y, %g_1 = %g) : (tensor<64xf32>, tensor<64xf32>) -> tensor<64xbf16> {
      %s = ve.sigmoid %y_1 : tensor<64xf32>
      %m = ve.mul %s, %g_1 : tensor<64xf32>
      %h_1 = ve.narrow %m : tensor<64xf32> -> tensor<64xbf16>
      ve.yield %h_1 : tensor<64xbf16>
    }

How: in every block (function bodies, loop bodies: any block but a chain's own), each op in
order that can start a chain grows one while the next op is the first user of the last
member's result (for a `ve.tag`, of its tags) and the members stay legal; the run is then cut
back from its end until it is legal as a whole (only its last result used outside) and has at
least two ops that run a stage. The chain takes the last member's place; its inputs are the
tensors the members read from outside, constants are copied into its body (the immediate
slots), and the members keep their attributes. Fusing changes costs, never values: the
interpreter runs the body op by op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block, Operation, Region, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from dialects import ve
from dialects.annotations import CLUSTER_ATTR, PHASE_ATTR
from dialects.ve_stages import chain_problem, is_chainable, runs_a_stage


def _next_member(last: Operation) -> Operation | None:
    """The op that continues the stream after `last`: the first user of its result, when all
    its users are later in the same block (a second user may join later, reading the result
    from the stash; if none does, the chain is cut back before `last`)."""
    block = last.parent_block()
    users = {use.operation for use in last.results[0].uses}
    if block is None or not users or any(u.parent_block() is not block for u in users):
        return None
    # The first user after `last`, once every user is known to follow it: a walk forward to
    # the last user, where positions in the block would each count from its start.
    first, left, op = None, len(users), last.next_op
    while op is not None:
        if op in users:
            if first is None:
                first = op
            left -= 1
            if not left:
                return first
        op = op.next_op
    return None


def grow_chain(first: Operation) -> list[Operation]:
    """The longest legal chain starting at `first`, or [] if none of two or more stage ops."""
    if not is_chainable(first) or chain_problem([first], complete=False) is not None:
        return []
    members = [first]
    while (nxt := _next_member(members[-1])) is not None and is_chainable(nxt) \
            and chain_problem([*members, nxt], complete=False) is None:
        members.append(nxt)
    while members and (sum(map(runs_a_stage, members)) < 2 or chain_problem(members) is not None):
        members.pop()
    return members


def build_chain(members: Sequence[Operation]) -> ve.ChainOp:
    """Move `members` (a legal chain, in order, in one block) into a `ve.chain` at the last
    member's place."""
    inside = set(members)
    inputs: list[SSAValue] = []
    constants: list[ve.ConstOp] = []
    for op in members:
        for v in op.operands:
            owner = v.owner
            if owner in inside:
                continue
            if isinstance(owner, ve.ConstOp):
                if owner not in constants:
                    constants.append(owner)
            elif v not in inputs:
                inputs.append(v)
    last = members[-1]
    body = Block(arg_types=[v.type for v in inputs])
    chain = ve.ChainOp(inputs, last.results[0].type, Region(body))
    for attr in (PHASE_ATTR, CLUSTER_ATTR):  # a chain runs where its members would have
        if attr in last.attributes:
            chain.attributes[attr] = last.attributes[attr]
    Rewriter.insert_op(chain, InsertPoint.before(last))
    chain.result.name_hint = last.results[0].name_hint
    last.results[0].replace_all_uses_with(chain.result)

    inner: dict[SSAValue, SSAValue] = {}
    for v, arg in zip(inputs, body.args, strict=True):
        arg.name_hint = v.name_hint
        inner[v] = arg
    for const in constants:
        copy = const.clone()
        body.add_op(copy)
        inner[const.result] = copy.result
    for op in members:
        op.detach()
        body.add_op(op)
        op.operands = [inner.get(v, v) for v in op.operands]
    end = ve.YieldOp(last.results[0])
    if PHASE_ATTR in last.attributes:
        end.attributes[PHASE_ATTR] = last.attributes[PHASE_ATTR]
    body.add_op(end)
    for const in constants:
        if const.parent is not None and not const.result.uses:
            Rewriter.erase_op(const)
    return chain


def fuse_block(block: Block) -> list[ve.ChainOp]:
    """Group every maximal legal run of `ve` ops in `block` into a chain, in order."""
    chains: list[ve.ChainOp] = []
    for op in list(block.ops):
        if op.parent_block() is not block:  # moved into a chain already
            continue
        members = grow_chain(op)
        if members:
            chains.append(build_chain(members))
    return chains


@dataclass(frozen=True)
class FuseVeChainsPass(ModulePass):
    name = "fuse-ve-chains"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        blocks = [block for inner in op.walk() if not isinstance(inner, ve.ChainOp)
                  for region in inner.regions for block in region.blocks]
        for block in blocks:
            fuse_block(block)
