"""`tcp`: the TCP engines other than the vector engine.

The contraction engine (einsum-like, bf16 or f32 operands, f32 accumulation) and the DMA engines
(row gathers and scatters by an index tensor, loads and stores between HBM and SRAM). A device
function cannot branch on runtime data, but a command may be guarded by a runtime scalar: a
contraction's `guard` operand names, per leading block, whether that block's command runs
(guard >= 0) or is skipped (its output is zero and it costs only the guard). DMA commands take
index -1 as "skip this row": nothing is read, zero is written. Numpy semantics are in
`runtime_sim/semantics/tcp_semantics.py`.
"""

from __future__ import annotations

import math
import re

from dataclasses import dataclass, replace
from typing import ClassVar

from xdsl.dialects.builtin import ArrayAttr, IntAttr, StringAttr, TensorType, f32
from xdsl.ir import Attribute, Dialect, ParametrizedAttribute, SSAValue
from xdsl.irdl import (
    AttrSizedOperandSegments,
    IRDLOperation,
    VarConstraint,
    base,
    irdl_attr_definition,
    irdl_op_definition,
    operand_def,
    opt_attr_def,
    opt_operand_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.parser import AttrParser
from xdsl.printer import Printer
from xdsl.utils.exceptions import VerifyException
from xdsl.traits import Pure

from dialects.lowp import check_pair, check_scales, k_block
from dialects.tensor_types import (
    broadcast_shapes,
    check_reshape,
    expect,
    format_type,
    is_float_type,
    is_int_type,
    shape_of,
    stored_bits,
)
from dialects.ve import WidenOp

_EINSUM = re.compile(r"^([a-z]+),([a-z]+)->([a-z]*)$")



def einsum_shape(spec: str, lhs: tuple[int, ...], rhs: tuple[int, ...]) -> tuple[int, ...]:
    """The result shape of a two-operand einsum, or a VerifyException saying what is wrong."""
    m = _EINSUM.match(spec)
    expect(m is not None, f"contraction spec {spec!r} is not of the form 'ab,bc->ac'")
    a, b, out = m.groups()
    expect(len(a) == len(lhs) and len(b) == len(rhs), f"spec {spec!r} does not match operand ranks {len(lhs)}, {len(rhs)}")
    sizes: dict[str, int] = {}
    for letters, shape in ((a, lhs), (b, rhs)):
        for letter, size in zip(letters, shape):
            expect(sizes.setdefault(letter, size) == size, f"axis '{letter}' is {sizes[letter]} and {size}")
    expect(len(set(out)) == len(out) and set(out) <= set(sizes), f"bad result axes in {spec!r}")
    return tuple(sizes[c] for c in out)


def contracted_size(spec: str, lhs: tuple[int, ...], rhs: tuple[int, ...]) -> int:
    """The number of multiply-accumulates per result element (the product of summed axes)."""
    a, b, out = _EINSUM.match(spec).groups()
    sizes = dict(zip(a, lhs)) | dict(zip(b, rhs))
    n = 1
    for letter in set(a + b) - set(out):
        n *= sizes[letter]
    return n


@dataclass(frozen=True)
class ContractionRoles:
    """A contraction's axes by role, each role's size the product of its axes: batch `g` (both
    operands and the result), the lhs's free axes `m`, the rhs's free axes `n`, and the summed
    axes `k`; `letters` names each role by the spec's letters (what a mapping is written in)."""

    g: int
    m: int
    n: int
    k: int
    letters: dict[str, str]
    lhs_bits: int = 16
    rhs_bits: int = 16
    result_bits: int = 32
    block_scaled: bool = False
    """A tcp.scaled_contract: low-precision operand pairs with block scales."""
    accumulates: bool = False
    """The command reads an f32 accumulator (`acc`)."""
    scale_blocks: int = 0
    """A block-scaled contraction's K-blocks per result element (k / k_block): the partial sums
    the vector engine scales and adds, each in the slice that computed it; 0 otherwise."""
    lhs_bf16: bool = False
    """The lhs is f32 widened from bf16 (`ve.widen`): every value is exactly a bf16."""
    rhs_bf16: bool = False
    """The rhs likewise."""


def contraction_roles(spec: str, lhs: tuple[int, ...], rhs: tuple[int, ...]) -> ContractionRoles:
    """The roles of a well-formed contraction's axes (see ContractionRoles). An axis of one
    operand that the result drops is summed, so it counts as contracted."""
    a, b, out = _EINSUM.match(spec).groups()
    sizes = dict(zip(a, lhs)) | dict(zip(b, rhs))
    groups = {"g": [c for c in out if c in a and c in b], "m": [c for c in out if c in a and c not in b],
              "n": [c for c in out if c in b and c not in a], "k": [c for c in dict.fromkeys(a + b) if c not in out]}
    size = {role: math.prod(sizes[c] for c in cs) for role, cs in groups.items()}
    return ContractionRoles(size["g"], size["m"], size["n"], size["k"],
                            {role: "".join(cs) for role, cs in groups.items() if cs})


def _roles_of(op: ContractOp | ScaledContractOp, spec: str) -> ContractionRoles:
    """The roles of a contraction op with its operands' stored widths."""
    lt, rt, out = op.lhs.type, op.rhs.type, op.result.type
    roles = contraction_roles(spec, shape_of(lt), shape_of(rt))
    return replace(roles, lhs_bits=stored_bits(lt.get_element_type()), rhs_bits=stored_bits(rt.get_element_type()),
                   result_bits=stored_bits(out.get_element_type()), block_scaled=isinstance(op, ScaledContractOp),
                   accumulates=op.acc is not None, lhs_bf16=isinstance(op.lhs.owner, WidenOp),
                   rhs_bf16=isinstance(op.rhs.owner, WidenOp))


BATCH_LETTERS = "abcdefghijlopqrstuvwxyz"
"""Letters for batch axes in a matmul's spec: all but k, m and n."""


def matmul_contraction(lhs: tuple[int, ...], rhs: tuple[int, ...]) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """numpy.matmul of lhs [..., M, K] by rhs [..., K, N] as a contraction: its spec and the
    shapes the operands are viewed as. Batch axes broadcast as numpy does, made explicit: an
    operand whose batch axis has size 1 where the result's has more (or that lacks the axis)
    leaves that letter out of its side of the spec, and the contraction reuses it for every
    index of the axis: `[2, 1, M, K] @ [3, K, N]` is `amk,bkn->abmn` on views [2, M, K] and
    [3, K, N]."""
    batch = broadcast_shapes(lhs[:-2], rhs[:-2])
    assert batch is not None and lhs[-1] == rhs[-2] and len(batch) <= len(BATCH_LETTERS)
    letters = BATCH_LETTERS[: len(batch)]

    def side(shape: tuple[int, ...], tail: str) -> tuple[str, tuple[int, ...]]:
        offset = len(batch) - (len(shape) - 2)
        kept = [a for a in range(offset, len(batch)) if shape[a - offset] == batch[a]]
        return "".join(letters[a] for a in kept) + tail, tuple(batch[a] for a in kept) + tuple(shape[-2:])

    (ls, lview), (rs, rview) = side(tuple(lhs), "mk"), side(tuple(rhs), "kn")
    return f"{ls},{rs}->{letters}mn", lview, rview


MAPPING_FIELDS = ("trf", "slices", "lanes", "broadcast", "packet", "k_chunk", "trf_mode")
MAPPING_ENGINES = ("contraction", "vector", "bf16x9")
"""A mapping's engines (target/contraction_mapping.py's ENGINES); all but the first are named
first in the attribute."""


@irdl_attr_definition
class MappingAttr(ParametrizedAttribute):
    """How a contraction is placed on one cluster's contraction engine, in the furiosa-opt book's
    terms (target/contraction_mapping.py states the rules and the cost): the stationary operand
    (`trf`, held in the TRF), the slices each of the batch, lhs-free and rhs-free roles is split
    over, the stationary axis' Lane, the Stream Adapter's Time Broadcast, the contracted axis'
    Packet (elements), the contracted extent one TRF load holds, and the TRF's double-buffering
    mode. `#tcp.mapping<vector, slices = [g, m, n]>`: an f32 x f32 contraction on the vector
    engine; `#tcp.mapping<bf16x9, trf = ..., ...>`: one on the multipliers, as the nine products
    of its operands' bf16 pieces (the other fields place that contraction)."""

    name = "tcp.mapping"

    engine: StringAttr
    trf: StringAttr
    slices: ArrayAttr[IntAttr]
    lanes: IntAttr
    broadcast: IntAttr
    packet: IntAttr
    k_chunk: IntAttr
    trf_mode: StringAttr

    @staticmethod
    def make(engine: str, trf: str, slices: tuple[int, int, int], lanes: int, broadcast: int, packet: int,
             k_chunk: int, trf_mode: str) -> MappingAttr:
        return MappingAttr(StringAttr(engine), StringAttr(trf), ArrayAttr([IntAttr(s) for s in slices]),
                           IntAttr(lanes), IntAttr(broadcast), IntAttr(packet), IntAttr(k_chunk), StringAttr(trf_mode))

    def fields(self) -> dict[str, object]:
        """The mapping as plain values, the keyword arguments of target.contraction_mapping.Mapping."""
        return {"engine": self.engine.data, "trf": self.trf.data, "slices": tuple(s.data for s in self.slices.data),
                "lanes": self.lanes.data, "broadcast": self.broadcast.data, "packet": self.packet.data,
                "k_chunk": self.k_chunk.data, "trf_mode": self.trf_mode.data}

    def print_parameters(self, printer: Printer) -> None:
        f = self.fields()
        slices = f"slices = [{', '.join(map(str, f['slices']))}]"
        if f["engine"] == "vector":
            printer.print_string(f"<vector, {slices}>")
            return
        rest = ", ".join(f"{k} = {f[k]}" for k in MAPPING_FIELDS[2:])
        engine = "" if f["engine"] == "contraction" else f"{f['engine']}, "
        printer.print_string(f"<{engine}trf = {f['trf']}, {slices}, {rest}>")

    @classmethod
    def parse_parameters(cls, parser: AttrParser) -> list[Attribute]:
        values: dict[str, object] = {}

        def parse_field() -> None:
            pos = parser.pos
            key = parser.parse_identifier()
            if key in MAPPING_ENGINES[1:] and not values:
                values["engine"] = key
                return
            if key not in MAPPING_FIELDS or key in values:
                parser.raise_error(f"#tcp.mapping: unknown or repeated field '{key}' (fields: {', '.join(MAPPING_FIELDS)})",
                                   pos, parser.pos)
            parser.parse_punctuation("=")
            if key == "slices":
                values[key] = tuple(parser.parse_comma_separated_list(
                    parser.Delimiter.SQUARE, lambda: parser.parse_integer(allow_boolean=False)))
            elif key in ("trf", "trf_mode"):
                values[key] = parser.parse_identifier()
            else:
                values[key] = parser.parse_integer(allow_boolean=False)

        parser.parse_comma_separated_list(parser.Delimiter.ANGLE, parse_field)
        engine = values.pop("engine", "contraction")
        needed = ("slices",) if engine == "vector" else MAPPING_FIELDS
        missing = [k for k in needed if k not in values]
        if missing or (engine == "vector" and set(values) != {"slices"}):
            parser.raise_error(f"#tcp.mapping needs {', '.join(needed)}" + ("" if engine == "contraction" else " only"))
        if engine == "vector":
            values |= {"trf": "lhs", "lanes": 1, "broadcast": 1, "packet": 1, "k_chunk": 1, "trf_mode": "full"}
        return list(MappingAttr.make(engine, **values).parameters)  # type: ignore[arg-type]

    def verify(self) -> None:
        f = self.fields()
        if len(f["slices"]) != 3 or min(f["slices"]) < 1:
            raise VerifyException(f"#tcp.mapping: slices must be three positive counts [g, m, n], got {list(f['slices'])}")
        if f["engine"] not in MAPPING_ENGINES or f["trf"] not in ("lhs", "rhs") \
                or f["trf_mode"] not in ("half", "full"):
            raise VerifyException(f"#tcp.mapping: engine must be contraction, vector or bf16x9, trf lhs or rhs and "
                                  f"trf_mode half or full, got {f['engine']}, {f['trf']}, {f['trf_mode']}")
        if f["lanes"] not in (1, 2, 4, 8):
            raise VerifyException(f"#tcp.mapping: lanes = {f['lanes']}; the Outer stage takes 1, 2, 4 or 8")
        if min(f["broadcast"], f["packet"], f["k_chunk"]) < 1:
            raise VerifyException("#tcp.mapping: broadcast, packet and k_chunk must be positive")


def check_mapping(mapping: MappingAttr | None, roles: ContractionRoles) -> None:
    """The machine-independent rules of a contraction's mapping: every role split over no more
    slices than it has elements (each slice gets part of it, each element one slice)."""
    if mapping is None:
        return
    for role, s, extent in zip("gmn", mapping.fields()["slices"], (roles.g, roles.m, roles.n)):  # type: ignore[call-overload]
        expect(s <= extent, f"mapping splits {roles.letters.get(role, role)} (size {extent}) over {s} slices")


@irdl_op_definition
class ContractOp(IRDLOperation):
    """`einsum(spec, lhs, rhs) + bias` on the contraction engine, accumulated in f32 and rounded
    to the result type. With `guard` (i32, one entry per block of the result's first axis), a
    block whose guard is negative is skipped and left zero.

    With `acc` (f32, the result's type, which is then f32 too), the sum starts from `acc`
    instead of zero: the engine reads the accumulator and adds the products to it in K order,
    so a contraction tiled along K (an expert's F tiles) passes each tile's result to the next
    and gives the whole contraction's bits (`numerics.contract`). A skipped block keeps `acc`."""

    name = "tcp.contract"
    spec = prop_def(StringAttr)
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    bias = opt_operand_def(TensorType)
    guard = opt_operand_def(TensorType)
    acc = opt_operand_def(TensorType)
    result = result_def(TensorType)
    mapping = opt_attr_def(MappingAttr)
    """How the command is placed on the contraction engine (the map-contractions pass's choice,
    or a hand-written one the cost model checks against the target)."""
    traits = traits_def(Pure())
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    assembly_format = (
        "$spec $lhs `,` $rhs (`acc` $acc^)? (`bias` $bias^)? (`guard` $guard^)? `:` type($lhs) `,` type($rhs) "
        "(`acc` type($acc)^)? (`bias` type($bias)^)? (`guard` type($guard)^)? `->` type($result) attr-dict"
    )

    def __init__(self, spec: str, lhs: SSAValue, rhs: SSAValue, result_type: Attribute,
                 bias: SSAValue | None = None, guard: SSAValue | None = None, acc: SSAValue | None = None):
        super().__init__(
            operands=[lhs, rhs, bias, guard, acc],
            result_types=[result_type],
            properties={"spec": StringAttr(spec)},
        )

    def roles(self) -> ContractionRoles:
        """The axes by role and the operands' widths: what a mapping is chosen for."""
        return _roles_of(self, self.spec.data)

    def verify_(self) -> None:
        lt, rt = self.lhs.type, self.rhs.type
        for t in (lt, rt):
            expect(is_float_type(t.get_element_type()), f"contraction operands must be bf16 or f32, got {format_type(t)}")
        shape = einsum_shape(self.spec.data, shape_of(lt), shape_of(rt))
        expect(shape_of(self.result.type) == shape, f"result should have shape {list(shape)}")
        expect(is_float_type(self.result.type.get_element_type()), "result must be float")
        if self.bias is not None:
            bs = shape_of(self.bias.type)
            expect(broadcast_shapes(bs, shape) == shape, f"bias {format_type(self.bias.type)} does not broadcast to {list(shape)}")
        if self.guard is not None:
            gt = self.guard.type
            expect(is_int_type(gt.get_element_type()) and shape_of(gt) == shape[:1],
                    f"guard must be i32 [{shape[0] if shape else ''}] (one per block), got {format_type(gt)}")
        check_mapping(self.mapping, self.roles())
        if self.acc is not None:
            want = TensorType(f32, shape)
            expect(self.acc.type == want and self.result.type == want,
                   f"the accumulator and the result must both be {format_type(want)}, got "
                   f"{format_type(self.acc.type)} and {format_type(self.result.type)}")


@irdl_op_definition
class ScaledContractOp(IRDLOperation):
    """Block-scaled contraction `gbd,gdf->gbf` of low-precision operands into f32: lhs
    [G, B, D] with scales [G, B, D / kx], rhs [G, D, F] with scales [G, D / kw, F / nb].

    The contraction engine multiplies matched pairs (f8e4m3 x f8e4m3, f8e5m2 x f8e5m2; an
    f4e2m1 rhs is turned into f8e4m3 by the fetch stage's lookup table) and reduces each
    K-block of min(kx, kw) elements into an f32 partial sum; the vector engine, next in the
    chain, multiplies the partial sum by its two scales (lhs scale * rhs scale, in f32) and
    adds it to the running sum in K order; then `bias` (broadcasting to [G, B, F]). The
    partial sums never leave the chain. With `guard` (i32 [G]), a block whose guard is
    negative is skipped and left zero. With `acc` (f32, the result's type) the running sum
    starts from `acc`: a contraction tiled along D at K-block edges (an expert's F tiles of a
    down-projection) passes each tile's sum to the next and gives the whole contraction's bits;
    a skipped block keeps `acc`. Semantics: `quantization.scaled_contract`."""

    name = "tcp.scaled_contract"
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    lhs_scales = operand_def(TensorType)
    rhs_scales = operand_def(TensorType)
    bias = opt_operand_def(TensorType)
    guard = opt_operand_def(TensorType)
    acc = opt_operand_def(TensorType)
    result = result_def(TensorType)
    mapping = opt_attr_def(MappingAttr)
    """As tcp.contract's: the placement of the contraction on the engine."""
    traits = traits_def(Pure())
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    assembly_format = (
        "$lhs `,` $rhs `scales` $lhs_scales `,` $rhs_scales (`acc` $acc^)? (`bias` $bias^)? (`guard` $guard^)? `:` "
        "type($lhs) `,` type($rhs) `,` type($lhs_scales) `,` type($rhs_scales) "
        "(`acc` type($acc)^)? (`bias` type($bias)^)? (`guard` type($guard)^)? `->` type($result) attr-dict"
    )

    def __init__(self, lhs: SSAValue, rhs: SSAValue, lhs_scales: SSAValue, rhs_scales: SSAValue,
                 bias: SSAValue | None = None, guard: SSAValue | None = None, acc: SSAValue | None = None):
        g, b, _ = shape_of(lhs.type)
        f = shape_of(rhs.type)[2]
        super().__init__(operands=[lhs, rhs, lhs_scales, rhs_scales, bias, guard, acc],
                         result_types=[TensorType(f32, [g, b, f])])

    def roles(self) -> ContractionRoles:
        """The axes by role, the operands' widths and the K-blocks of each result element:
        what a mapping is chosen for."""
        return replace(_roles_of(self, "gbd,gdf->gbf"), scale_blocks=shape_of(self.lhs.type)[2] // self.k_block)

    @property
    def k_block(self) -> int:
        """Elements of D in one partial sum."""
        d = shape_of(self.lhs.type)[2]
        return min(d // shape_of(self.lhs_scales.type)[2], d // shape_of(self.rhs_scales.type)[1])

    def verify_(self) -> None:
        ls, rs = shape_of(self.lhs.type), shape_of(self.rhs.type)
        expect(len(ls) == 3 and len(rs) == 3 and ls[0] == rs[0] and ls[2] == rs[1],
               f"scaled_contract takes [G, B, D] and [G, D, F], got {format_type(self.lhs.type)} and {format_type(self.rhs.type)}")
        check_pair(self.lhs.type.get_element_type(), self.rhs.type.get_element_type(), "scaled_contract")
        lb = check_scales(self.lhs.type, self.lhs_scales.type, "lhs")
        rb = check_scales(self.rhs.type, self.rhs_scales.type, "rhs")
        expect(lb[:2] == (1, 1) and rb[0] == 1, "scales must be per row of lhs and per block of rhs")
        expect(k_block(lb[2], rb[1]) is not None, f"the K-blocks of the scales ({lb[2]} and {rb[1]}) do not nest")
        shape = (ls[0], ls[1], rs[2])
        expect(self.result.type == TensorType(f32, shape), f"result must be f32 {list(shape)}")
        check_mapping(self.mapping, self.roles())
        if self.bias is not None:
            expect(broadcast_shapes(shape_of(self.bias.type), shape) == shape,
                   f"bias {format_type(self.bias.type)} does not broadcast to {list(shape)}")
        if self.guard is not None:
            gt = self.guard.type
            expect(is_int_type(gt.get_element_type()) and shape_of(gt) == shape[:1],
                   f"guard must be i32 [{shape[0]}] (one per block), got {format_type(gt)}")
        if self.acc is not None:
            expect(self.acc.type == self.result.type,
                   f"the accumulator must be the result's {format_type(self.result.type)}, got {format_type(self.acc.type)}")


@irdl_op_definition
class DmaGatherOp(IRDLOperation):
    """Rows of `source` (its first axis) picked by `indices`: result[i...] = source[indices[i...]].
    Index -1 skips the row (nothing is read, zero is written); other out-of-range indices are an
    execution error."""

    name = "tcp.dma_gather"
    source = operand_def(TensorType)
    indices = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "$source `[` $indices `]` `:` type($source) `,` type($indices) `->` type($result) attr-dict"
    )

    def __init__(self, source: SSAValue, indices: SSAValue):
        st, it = source.type, indices.type
        shape = [*shape_of(it), *shape_of(st)[1:]]
        super().__init__(operands=[source, indices], result_types=[TensorType(st.get_element_type(), shape)])

    def verify_(self) -> None:
        st, it = self.source.type, self.indices.type
        expect(is_int_type(it.get_element_type()), "indices must be i32")
        expect(len(shape_of(st)) >= 1, "source needs a row axis")
        want = TensorType(st.get_element_type(), [*shape_of(it), *shape_of(st)[1:]])
        expect(self.result.type == want, f"result should be {want}")


@irdl_op_definition
class DmaScatterOp(IRDLOperation):
    """Rows of `source` written into a zeroed buffer of `rows` rows: source row s goes to every
    row named by indices[s, ...] (a row may be sent to several places). Index -1 skips; two
    writes to one row are an execution error."""

    name = "tcp.dma_scatter"
    source = operand_def(TensorType)
    indices = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "$source `[` $indices `]` `:` type($source) `,` type($indices) `->` type($result) attr-dict"
    )

    def __init__(self, source: SSAValue, indices: SSAValue, rows: int):
        st = source.type
        super().__init__(
            operands=[source, indices],
            result_types=[TensorType(st.get_element_type(), [rows, *shape_of(st)[1:]])],
        )

    def verify_(self) -> None:
        st, it, rt = self.source.type, self.indices.type, self.result.type
        expect(is_int_type(it.get_element_type()), "indices must be i32")
        ss, ids = shape_of(st), shape_of(it)
        expect(len(ss) >= 1 and len(ids) >= 1 and ids[0] == ss[0],
                f"indices {format_type(it)} must have one leading entry per source row ({ss[0] if ss else 0})")
        expect(rt.get_element_type() == st.get_element_type() and shape_of(rt)[1:] == ss[1:],
                "result rows must have the source's row shape and type")


class CopyOpBase(IRDLOperation):
    """A DMA copy between memories; the value is unchanged (tcp.load, tcp.store, tile.copy)."""

    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$input `:` type($input) `->` type($result) attr-dict"

    def __init__(self, input: SSAValue):
        super().__init__(operands=[input], result_types=[input.type])

    def verify_(self) -> None:
        expect(self.result.type == self.input.type, "a copy keeps the type")


@irdl_op_definition
class LoadOp(CopyOpBase):
    """HBM to SRAM."""

    name = "tcp.load"


@irdl_op_definition
class StoreOp(CopyOpBase):
    """SRAM to HBM."""

    name = "tcp.store"


@irdl_op_definition
class ViewOp(IRDLOperation):
    """The same buffer with another row-major shape: no data moves, no engine runs."""

    name = "tcp.view"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$input `:` type($input) `->` type($result) attr-dict"

    def __init__(self, input: SSAValue, shape: list[int]):
        super().__init__(operands=[input], result_types=[TensorType(input.type.get_element_type(), shape)])

    def verify_(self) -> None:
        check_reshape(self.input.type, self.result.type, "view")


@irdl_op_definition
class OrderOp(IRDLOperation):
    """`input` as it is, ready only once `after` is made: a data dependence and nothing else.

    pin-routing puts one between the router's expert indices and the routing argument that
    replaces them, so that what reads the pinned routing waits for the router as it would for
    its indices. No data moves and no engine runs: the simulator costs it as nothing and keeps
    the result in `after`'s buffer, where the router left its indices; `after`'s value is never
    read (cost-only mode does not compute it)."""

    name = "tcp.order"
    T: ClassVar = VarConstraint("T", base(TensorType))
    input = operand_def(T)
    after = operand_def(TensorType)
    result = result_def(T)
    traits = traits_def(Pure())
    assembly_format = "$input `after` $after `:` type($input) `,` type($after) attr-dict"

    def __init__(self, input: SSAValue, after: SSAValue):
        super().__init__(operands=[input, after], result_types=[input.type])


TCP = Dialect("tcp", [ContractOp, ScaledContractOp, DmaGatherOp, DmaScatterOp, LoadOp, StoreOp, ViewOp, OrderOp],
              [MappingAttr])
