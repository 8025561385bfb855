"""`moe`: the four Mixture-of-Experts ops and the routing-plan type.

`moe.scatter` places the T*K (token, expert) pairs into G fixed-size blocks of B rows, in the
canonical layout (docs/architecture.md#the-routing-plan-and-the-block-layout), and yields the
routing plan as a `!moe.route` value that `grouped_matmul` and `combine` consume. G is the
exact worst case over all routings, so no routing can overflow the static buffers. Numpy
semantics are in `runtime_sim/semantics/moe_semantics.py`.
"""

from __future__ import annotations

from xdsl.dialects.builtin import (
    IntAttr,
    IntegerAttr,
    IntegerType,
    StringAttr,
    TensorType,
    bf16,
    f32,
    i32,
    i64,
)
from xdsl.ir import Attribute, Dialect, ParametrizedAttribute, SSAValue, TypeAttribute
from xdsl.irdl import (
    IRDLOperation,
    ParsePropInAttrDict,
    irdl_attr_definition,
    irdl_op_definition,
    operand_def,
    opt_operand_def,
    opt_prop_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.parser import AttrParser
from xdsl.printer import Printer
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from dialects.lowp import check_pair, check_scales, k_block
from dialects.tensor_types import expect, format_type, is_float_type, is_int_type, promote, shape_of

TOPK_ORDERS = ("score", "index")
"""`score`: larger score first (the default, as torch.topk(sorted=True) returns them);
`index`: ascending expert index, the order filter compaction yields without a sort."""


def max_blocks(tokens: int, k: int, experts: int, block: int, capacity: int | None = None) -> int:
    """The exact maximum of sum_e ceil(kept_e / block) over every routing.

    Each token picks k distinct experts, so an expert receives at most `tokens` pairs, and at
    most `capacity` of them are kept. Any counts with c_e <= tokens and sum c_e = tokens * k are
    realisable, and adding pairs never removes a block, so the maximum spends one pair on the
    first block of as many experts as possible and `block` pairs on each further block, up to
    ceil(cap / block) blocks per expert.
    """
    pairs = tokens * k
    cap = tokens if capacity is None else min(tokens, capacity)
    if cap <= 0 or pairs == 0:
        return 0
    opened = min(experts, pairs)
    further = min((pairs - opened) // block, opened * (-(-cap // block) - 1))
    return opened + further


@irdl_attr_definition
class RouteType(ParametrizedAttribute, TypeAttribute):
    """The routing plan of one `moe.scatter`: T tokens, K choices, E experts, blocks of B rows,
    G blocks, and optionally the per-expert capacity C (pairs beyond it are dropped)."""

    name = "moe.route"

    tokens: IntAttr
    k: IntAttr
    experts: IntAttr
    block: IntAttr
    blocks: IntAttr
    capacity: IntAttr
    """0 means no capacity limit."""

    @staticmethod
    def make(tokens: int, k: int, experts: int, block: int, capacity: int | None = None) -> RouteType:
        blocks = max_blocks(tokens, k, experts, block, capacity)
        return RouteType(*(IntAttr(v) for v in (tokens, k, experts, block, blocks, capacity or 0)))

    @property
    def capacity_limit(self) -> int | None:
        return self.capacity.data or None

    def print_parameters(self, printer: Printer) -> None:
        items = [f"{short} = {getattr(self, field).data}" for short, field in ROUTE_FIELDS]
        if not self.capacity.data:
            items.pop()
        printer.print_string("<" + ", ".join(items) + ">")

    @classmethod
    def parse_parameters(cls, parser: AttrParser) -> list[Attribute]:
        values: dict[str, int] = {}

        def parse_field() -> None:
            name = parser.parse_identifier()
            parser.parse_punctuation("=")
            values[name] = parser.parse_integer(allow_boolean=False)

        parser.parse_comma_separated_list(parser.Delimiter.ANGLE, parse_field)
        shorts = [s for s, _ in ROUTE_FIELDS]
        if set(values) - set(shorts) or not set(shorts[:-1]) <= set(values):
            parser.raise_error(f"!moe.route needs {', '.join(shorts[:-1])} and optionally C")
        values.setdefault("C", 0)
        return [IntAttr(values[s]) for s in shorts]

    def verify(self) -> None:
        t, k, e, b, g, c = (getattr(self, f).data for _, f in ROUTE_FIELDS)
        if min(t, k, e, b) < 1:
            raise VerifyException(f"!moe.route: T, K, E and B must be positive (T={t} K={k} E={e} B={b})")
        if k > e:
            raise VerifyException(f"!moe.route: K = {k} exceeds E = {e}")
        if c < 0:
            raise VerifyException(f"!moe.route: capacity {c} is negative")
        expected = max_blocks(t, k, e, b, c or None)
        if g != expected:
            raise VerifyException(f"!moe.route: G = {g}, but the worst case for this routing is {expected}")


ROUTE_FIELDS = (("T", "tokens"), ("K", "k"), ("E", "experts"), ("B", "block"), ("G", "blocks"), ("C", "capacity"))
"""The printed short names of RouteType's parameters, in order."""



@irdl_op_definition
class TopKOp(IRDLOperation):
    """The k largest values along the last axis and their i32 indices.

    Larger first; equal values (-0.0 == +0.0) go to the lower index; NaN is never chosen over a
    number, NaNs among themselves by lower index; indices of a row are distinct. `order` picks
    the result order (default `score`)."""

    name = "moe.topk"
    k = prop_def(IntegerAttr[IntegerType])
    order = opt_prop_def(StringAttr)
    input = operand_def(TensorType)
    values = result_def(TensorType)
    indices = result_def(TensorType)
    traits = traits_def(Pure())
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$input attr-dict `:` type($input) `->` type($values) `,` type($indices)"

    def __init__(self, input, k: int, order: str = "score"):
        t = input.type
        shape = [*shape_of(t)[:-1], k]
        props: dict[str, Attribute] = {"k": IntegerAttr(k, i64)}
        if order != "score":
            props["order"] = StringAttr(order)
        super().__init__(
            operands=[input],
            result_types=[TensorType(t.get_element_type(), shape), TensorType(i32, shape)],
            properties=props,
        )

    @property
    def order_name(self) -> str:
        return self.order.data if self.order is not None else "score"

    def verify_(self) -> None:
        t = self.input.type
        shape = shape_of(t)
        k = self.k.value.data
        expect(len(shape) >= 1, "topk needs at least one axis")
        expect(is_float_type(t.get_element_type()) or is_int_type(t.get_element_type()), "topk takes bf16, f32 or i32")
        expect(1 <= k <= shape[-1], f"k = {k} must be in [1, {shape[-1]}] (the last axis)")
        expect(self.order_name in TOPK_ORDERS, f"order must be one of {', '.join(TOPK_ORDERS)}")
        out = [*shape[:-1], k]
        expect(self.values.type == TensorType(t.get_element_type(), out), "values type mismatch")
        expect(self.indices.type == TensorType(i32, out), "indices must be i32 of the values' shape")


@irdl_op_definition
class ScatterOp(IRDLOperation):
    """Tokens [T, D] into blocks [G, B, D] by the chosen experts [T, K], and the routing plan."""

    name = "moe.scatter"
    input = operand_def(TensorType)
    expert_idx = operand_def(TensorType)
    blocked = result_def(TensorType)
    route = result_def(RouteType)
    traits = traits_def(Pure())
    assembly_format = (
        "$input `,` $expert_idx attr-dict `:` type($input) `,` type($expert_idx) "
        "`->` type($blocked) `,` type($route)"
    )

    def __init__(self, input, expert_idx, route_type: RouteType):
        t = input.type
        g, b = route_type.blocks.data, route_type.block.data
        super().__init__(
            operands=[input, expert_idx],
            result_types=[TensorType(t.get_element_type(), [g, b, shape_of(t)[1]]), route_type],
        )

    def verify_(self) -> None:
        r = self.route.type
        xs, es = shape_of(self.input.type), shape_of(self.expert_idx.type)
        expect(len(xs) == 2, f"input must be [T, D], got {format_type(self.input.type)}")
        expect(is_int_type(self.expert_idx.type.get_element_type()), "expert indices must be i32")
        expect(
            es == (r.tokens.data, r.k.data),
            f"expert indices {format_type(self.expert_idx.type)} do not match T = {r.tokens.data}, K = {r.k.data}",
        )
        expect(xs[0] == r.tokens.data, f"input has {xs[0]} tokens, the route {r.tokens.data}")
        expected = TensorType(self.input.type.get_element_type(), [r.blocks.data, r.block.data, xs[1]])
        expect(self.blocked.type == expected, f"blocked result should be {expected}")


@irdl_op_definition
class GroupedMatmulOp(IRDLOperation):
    """Each block [B, D] times its expert's weight [D, F], plus the expert's bias [F] if given.

    Accumulates in f32 and rounds to the result type: the operands' promoted type, or f32,
    which keeps the unrounded sum (a tensor-parallel shard's partial down projection, summed
    over the chips before the one rounding). Padding rows and unused blocks are zero (the bias
    is not added to them), so padding never leaks into later ops."""

    name = "moe.grouped_matmul"
    input = operand_def(TensorType)
    weight = operand_def(TensorType)
    route = operand_def(RouteType)
    bias = opt_operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "$input `,` $weight `,` $route (`bias` $bias^)? attr-dict `:` type($input) `,` type($weight) "
        "`,` type($route) (`,` type($bias)^)? `->` type($result)"
    )

    def __init__(self, input, weight, route, bias=None, result_element: Attribute | None = None):
        g, b, _ = shape_of(input.type)
        f = shape_of(weight.type)[2]
        et = result_element or promote(input.type.get_element_type(), weight.type.get_element_type())
        super().__init__(
            operands=[input, weight, route, bias],
            result_types=[TensorType(et, [g, b, f])],
        )

    def verify_(self) -> None:
        r = self.route.type
        assert isinstance(r, RouteType)
        xs, ws = shape_of(self.input.type), shape_of(self.weight.type)
        expect(len(xs) == 3 and xs[:2] == (r.blocks.data, r.block.data),
                f"input {format_type(self.input.type)} is not [G, B, D] with G = {r.blocks.data}, B = {r.block.data}")
        expect(len(ws) == 3 and ws[0] == r.experts.data and ws[1] == xs[2],
                f"weight {format_type(self.weight.type)} is not [E, D, F] with E = {r.experts.data}, D = {xs[2]}")
        et = promote(self.input.type.get_element_type(), self.weight.type.get_element_type())
        expect(et is not None and is_float_type(et), "grouped_matmul needs float operands")
        if self.bias is not None:
            bs = shape_of(self.bias.type)
            expect(bs == (ws[0], ws[2]), f"bias {format_type(self.bias.type)} is not [E, F] = [{ws[0]}, {ws[2]}]")
            expect(is_float_type(self.bias.type.get_element_type()), "bias must be float")
        expect(self.result.type in (TensorType(et, [xs[0], xs[1], ws[2]]), TensorType(f32, [xs[0], xs[1], ws[2]])),
               f"result type mismatch: expected {format_type(TensorType(et, [xs[0], xs[1], ws[2]]))} or its f32")


@irdl_op_definition
class ScaledGroupedMatmulOp(IRDLOperation):
    """`grouped_matmul` of block-scaled low-precision operands: blocks [G, B, D] with scales
    [G, B, D / kx] (per row and K-group, as `lowp.quantize` gives them) times each block's
    expert weight [D, F] with scales [E, D / kw, F / nb].

    As the chip does it: the contraction engine multiplies matched low-precision pairs
    (f8e4m3 x f8e4m3, f8e5m2 x f8e5m2; f4e2m1 weights become f8e4m3 in the fetch stage's
    lookup table) into f32 partial sums over each K-block of min(kx, kw) elements; the vector
    engine multiplies each partial sum by its row's and its weight block's scales (f32, in
    that order) and adds them in K order, strictly left to right, then the bias if given.
    Padding rows and unused blocks are zero; the result is rounded once to bf16."""

    name = "moe.scaled_grouped_matmul"
    input = operand_def(TensorType)
    weight = operand_def(TensorType)
    route = operand_def(RouteType)
    input_scales = operand_def(TensorType)
    weight_scales = operand_def(TensorType)
    bias = opt_operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "$input `,` $weight `,` $route `scales` $input_scales `,` $weight_scales (`bias` $bias^)? attr-dict `:` "
        "type($input) `,` type($weight) `,` type($route) `,` type($input_scales) `,` type($weight_scales) "
        "(`,` type($bias)^)? `->` type($result)"
    )

    def __init__(self, input, weight, route, input_scales, weight_scales, bias=None):
        g, b, _ = shape_of(input.type)
        f = shape_of(weight.type)[2]
        super().__init__(
            operands=[input, weight, route, input_scales, weight_scales, bias],
            result_types=[TensorType(bf16, [g, b, f])],
        )

    def verify_(self) -> None:
        r = self.route.type
        assert isinstance(r, RouteType)
        xs, ws = shape_of(self.input.type), shape_of(self.weight.type)
        expect(len(xs) == 3 and xs[:2] == (r.blocks.data, r.block.data),
               f"input {format_type(self.input.type)} is not [G, B, D] with G = {r.blocks.data}, B = {r.block.data}")
        expect(len(ws) == 3 and ws[0] == r.experts.data and ws[1] == xs[2],
               f"weight {format_type(self.weight.type)} is not [E, D, F] with E = {r.experts.data}, D = {xs[2]}")
        check_pair(self.input.type.get_element_type(), self.weight.type.get_element_type(), "scaled_grouped_matmul")
        xb = check_scales(self.input.type, self.input_scales.type, "input")
        wb = check_scales(self.weight.type, self.weight_scales.type, "weight")
        expect(xb[:2] == (1, 1), "input scales must be per row: [G, B, D / group]")
        expect(wb[0] == 1, "weight scales must be per expert: [E, D / kw, F / nb]")
        expect(k_block(xb[2], wb[1]) is not None,
               f"the K-blocks of the scales ({xb[2]} for the input, {wb[1]} for the weight) do not nest")
        if self.bias is not None:
            bs = shape_of(self.bias.type)
            expect(bs == (ws[0], ws[2]), f"bias {format_type(self.bias.type)} is not [E, F] = [{ws[0]}, {ws[2]}]")
            expect(is_float_type(self.bias.type.get_element_type()), "bias must be float")
        expect(self.result.type == TensorType(bf16, [xs[0], xs[1], ws[2]]), "result must be bf16 [G, B, F]")


@irdl_op_definition
class CombineOp(IRDLOperation):
    """Blocks [G, B, D] back to tokens [T, D]: out[t] = sum over k in order 0..K-1 of
    weight[t, k] * blocks[row of pair (t, k)], in f32, rounded to the blocks' type. A dropped
    pair contributes zero. Without weights, the plain sum."""

    name = "moe.combine"
    input = operand_def(TensorType)
    route = operand_def(RouteType)
    weights = opt_operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "$input `,` $route (`weights` $weights^)? attr-dict `:` type($input) `,` type($route) "
        "(`,` type($weights)^)? `->` type($result)"
    )

    def __init__(self, input, route, weights=None):
        r = route.type
        d = shape_of(input.type)[2]
        super().__init__(
            operands=[input, route, weights],
            result_types=[TensorType(input.type.get_element_type(), [r.tokens.data, d])],
        )

    def verify_(self) -> None:
        r = self.route.type
        assert isinstance(r, RouteType)
        xs = shape_of(self.input.type)
        expect(len(xs) == 3 and xs[:2] == (r.blocks.data, r.block.data),
                f"input {format_type(self.input.type)} is not [G, B, D] with G = {r.blocks.data}, B = {r.block.data}")
        expect(is_float_type(self.input.type.get_element_type()), "combine needs a float input")
        if self.weights is not None:
            ws = shape_of(self.weights.type)
            expect(ws == (r.tokens.data, r.k.data),
                    f"weights {format_type(self.weights.type)} are not [T, K] = [{r.tokens.data}, {r.k.data}]")
            expect(is_float_type(self.weights.type.get_element_type()), "weights must be float")
        expected = TensorType(self.input.type.get_element_type(), [r.tokens.data, xs[2]])
        expect(self.result.type == expected, f"result should be {expected}")


@irdl_op_definition
class RouteOp(IRDLOperation):
    """Packs computed routing indices into a routing plan: what `lower-routing` leaves in place
    of `moe.scatter`'s second result, until the dispatch lowering consumes it."""

    name = "moe.route"
    scatter_idx = operand_def(TensorType)
    expert_ids = operand_def(TensorType)
    route = result_def(RouteType)
    traits = traits_def(Pure())
    assembly_format = (
        "$scatter_idx `,` $expert_ids attr-dict `:` type($scatter_idx) `,` type($expert_ids) `->` type($route)"
    )

    def __init__(self, scatter_idx, expert_ids, route_type: RouteType):
        super().__init__(operands=[scatter_idx, expert_ids], result_types=[route_type])

    def verify_(self) -> None:
        r = self.route.type
        assert isinstance(r, RouteType)
        want = (r.tokens.data, r.k.data)
        expect(self.scatter_idx.type == TensorType(i32, want), f"scatter_idx must be i32 {list(want)}")
        expect(self.expert_ids.type == TensorType(i32, [r.blocks.data]), f"expert_ids must be i32 [{r.blocks.data}]")


@irdl_op_definition
class PairRowsOp(IRDLOperation):
    """Where each pair of a routing plan sits in its blocks: `rows[t, k]` is the row (block * B +
    position) of pair (t, k) in the blocked buffer viewed as [G * B, ...], -1 for a dropped pair
    (the plan's scatter_idx). For a consumer that reads some pairs' rows in an order of its own
    (shard-experts' a2a receiver gathers a whole token's slots straight from the blocks)."""

    name = "moe.pair_rows"
    route = operand_def(RouteType)
    rows = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$route attr-dict `:` type($route) `->` type($rows)"

    def __init__(self, route: SSAValue):
        r = route.type
        assert isinstance(r, RouteType)
        super().__init__(operands=[route], result_types=[TensorType(i32, [r.tokens.data, r.k.data])])

    def verify_(self) -> None:
        r = self.route.type
        assert isinstance(r, RouteType)
        want = TensorType(i32, [r.tokens.data, r.k.data])
        expect(self.rows.type == want, f"rows must be {want}")


@irdl_op_definition
class DispatchOp(IRDLOperation):
    """Tokens [T, D] into blocks [G, B, D] by an existing routing plan: `moe.scatter`'s data
    movement once its index generation has been lowered."""

    name = "moe.dispatch"
    input = operand_def(TensorType)
    route = operand_def(RouteType)
    blocked = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$input `,` $route attr-dict `:` type($input) `,` type($route) `->` type($blocked)"

    def __init__(self, input, route):
        r = route.type
        t = input.type
        shape = [r.blocks.data, r.block.data, shape_of(t)[1]]
        super().__init__(operands=[input, route], result_types=[TensorType(t.get_element_type(), shape)])

    def verify_(self) -> None:
        r = self.route.type
        assert isinstance(r, RouteType)
        xs = shape_of(self.input.type)
        expect(len(xs) == 2 and xs[0] == r.tokens.data, f"input must be [T, D] with T = {r.tokens.data}")
        want = TensorType(self.input.type.get_element_type(), [r.blocks.data, r.block.data, xs[1]])
        expect(self.blocked.type == want, f"result should be {want}")


MoE = Dialect(
    "moe",
    [TopKOp, ScatterOp, GroupedMatmulOp, ScaledGroupedMatmulOp, CombineOp, RouteOp, DispatchOp, PairRowsOp],
    [RouteType],
)
