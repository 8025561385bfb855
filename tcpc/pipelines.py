"""The dialects and passes tcpc knows, and its named pipelines.

Every pass registers here once; `tcpc`, `tcpc-opt` and the Python API all read this table.
"""

from __future__ import annotations

import importlib
import time
from itertools import chain
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from xdsl.context import Context
from xdsl.dialects import arith, func, scf
from xdsl.dialects.builtin import Builtin, ModuleOp
from xdsl.dialects.dlti import DLTI
from xdsl.ir import Dialect, ErasedSSAValue, Operation, SSAValue
from xdsl.passes import ModulePass, PassPipeline
from xdsl.traits import (HasFolder, HasParent, IsolatedFromAbove, IsTerminator, NoTerminator, OpTrait, ReturnLike,
                         SingleBlockImplicitTerminator, SymbolOpInterface, SymbolTable)
from xdsl.utils.arg_spec import PipelineLexer, SpecTokenKind
from xdsl.utils.exceptions import ArgSpecParseError, VerifyException

from dialects.ccl import CCL
from dialects.lowp import LowP
from dialects.moe import MoE
from dialects.tcp import TCP
from dialects.tile import Tile
from dialects.tmath import TMath
from dialects.ve import VE
from runtime_sim.semantics.collector import without_gc_pauses
from target.machine import Machine
from target.target_spec import attach
from tcpc.provenance import Locating

DIALECTS: list[Dialect] = [Builtin, func.Func, TMath, MoE, VE, TCP, Tile, scf.Scf, arith.Arith, LowP, CCL, DLTI]


def _lazy(module: str, name: str) -> Callable[[], type[ModulePass]]:
    """A factory that imports the pass only when a pipeline asks for it."""

    def load() -> type[ModulePass]:
        return getattr(importlib.import_module(module), name)

    return load


PASSES: dict[str, Callable[[], type[ModulePass]]] = {
    "lower-topk": _lazy("passes.lowering.lower_topk", "LowerTopKPass"),
    "lower-routing": _lazy("passes.lowering.lower_routing", "LowerRoutingPass"),
    "lower-dispatch": _lazy("passes.lowering.lower_dispatch", "LowerDispatchPass"),
    "lower-math": _lazy("passes.lowering.lower_math", "LowerMathPass"),
    "lower-quant": _lazy("passes.lowering.lower_quant", "LowerQuantPass"),
    "load-arguments": _lazy("passes.lowering.load_arguments", "LoadArgumentsPass"),
    "pin-routing": _lazy("passes.lowering.pin_routing", "PinRoutingPass"),
    "schedule-shared": _lazy("passes.schedule.schedule_shared", "ScheduleSharedPass"),
    "schedule-experts": _lazy("passes.schedule.schedule_experts", "ScheduleExpertsPass"),
    "schedule-tokens": _lazy("passes.schedule.schedule_tokens", "ScheduleTokensPass"),
    "split-router-k": _lazy("passes.schedule.split_router_k", "SplitRouterKPass"),
    "split-clusters": _lazy("passes.schedule.split_clusters", "SplitClustersPass"),
    "interleave-shared": _lazy("passes.schedule.interleave_shared", "InterleaveSharedPass"),
    "interleave-chunks": _lazy("passes.schedule.interleave_chunks", "InterleaveChunksPass"),
    "return-waves": _lazy("passes.schedule.return_waves", "ReturnWavesPass"),
    "fuse-ve-chains": _lazy("passes.schedule.fuse_ve_chains", "FuseVeChainsPass"),
    "map-contractions": _lazy("passes.schedule.map_contractions", "MapContractionsPass"),
    "shard-experts": _lazy("passes.mesh.shard_experts", "ShardExpertsPass"),
}
"""Pass name -> factory of the pass class, as xDSL's pipeline parser wants them."""

LOWERED_PIPELINE: tuple[str, ...] = (
    "lower-topk", "lower-routing", "lower-dispatch", "lower-quant", "lower-math", "load-arguments",
)
"""The full lowering, in order: after it the IR holds only func, tcp, ve and builtin ops, each
working on whole tensors."""

SCHEDULE_PIPELINE: tuple[str, ...] = ("schedule-shared", "schedule-experts", "schedule-tokens", "split-router-k", "split-clusters",
                                      "fuse-ve-chains", "map-contractions", "interleave-shared",
                                      "interleave-chunks", "return-waves")
"""The schedule level, after the lowering: a shared expert rewritten as an expert loop of its
own (schedule-shared); static loops over blocks and token tiles whose
tiles fit SRAM, weights loaded once per expert and prefetched (docs/passes.md#the-schedule-level-schedule-shared-schedule-experts-schedule-tokens-split-router-k-split-clusters); a small router weight's load spread over the DMA engines in tiles of its reduction
axis (split-router-k); the expert loop spread over the chip's clusters (default: RNGD's two);
consecutive vector-engine ops, in every block, fused into one chain invocation each (docs/passes.md#fuse-ve-chains);
every contraction placed on its cluster's Slice, Lane, Time and Packet by the cost of each
engine stage (map-contractions, docs/passes.md#map-contractions); last, a shared expert's
contractions spread through the routed loop at prefill (interleave-shared,
docs/passes.md#interleave-shared-the-shared-expert-in-the-routed-loops-idle-time), whose
pieces of the routed loop then copy a body already fused and mapped."""

FULL_PIPELINE: tuple[str, ...] = LOWERED_PIPELINE + SCHEDULE_PIPELINE
"""What `tcpc run` simulates and `--emit scheduled` prints."""

LEVELS: dict[str, tuple[str, ...]] = {"lowered": LOWERED_PIPELINE, "scheduled": FULL_PIPELINE}
"""The levels of the full lowering that `tcpc compile --emit` prints: the engine ops on whole
tensors, and with the schedule level (what `tcpc run` simulates)."""

COST_ONLY_PASSES: tuple[str, ...] = ("pin-routing",)
"""What a cost-only simulation runs before any pipeline: the routing becomes an argument that
the routing scenario fills (runtime_sim/perf/cost_only.py)."""


def pipeline_spec(passes: tuple[str, ...] = FULL_PIPELINE, topk_strategy: str | None = "auto",
                  options: Mapping[str, object] | None = None, expert_order: str | None = None,
                  dispatch_quantize: str | None = None, shared_rows: str | None = None) -> str:
    """`passes` as a pipeline string: lower-topk's strategy left to the cost model by default
    (`strategy=auto`, resolved by the driver: rank's all-pairs ranking wins at small E, rounds
    at large E x T; None: the pass's own default), schedule-experts' loop order as
    `expert_order` (`auto`, what a run compiles with, is the cost model's choice of block or
    tile order; None: the pass's default), lower-dispatch's `quantize` as `dispatch_quantize`
    (where block-scaled activations are quantized, blocks or tokens; None: the pass's default),
    schedule-shared's `most_rows` as `shared_rows` (None: the pass's default), then `options` ("pass.option" -> value, a sweep's) over them. No machine number is written: every pass reads the machine from the module's
    target (target/target_spec.py), which the driver attaches; an option given here overrides
    it."""
    by_pass: dict[str, dict[str, str]] = {}
    if topk_strategy is not None:
        by_pass["lower-topk"] = {"strategy": topk_strategy}
    if dispatch_quantize is not None and "lower-dispatch" in passes:
        by_pass["lower-dispatch"] = {"quantize": dispatch_quantize}
    if shared_rows is not None and "schedule-shared" in passes:
        by_pass["schedule-shared"] = {"most_rows": shared_rows}
    if expert_order is not None and "schedule-experts" in passes:
        by_pass["schedule-experts"] = {"order": expert_order}
    for key, value in (options or {}).items():
        name, _, option = key.partition(".")
        by_pass.setdefault(name, {})[option] = str(value).lower() if isinstance(value, bool) else str(value)
    return ",".join(f"{p}{{{' '.join(f'{k}={v}' for k, v in by_pass[p].items())}}}" if by_pass.get(p) else p
                    for p in passes)


AUTO_OPTIONS: dict[str, str] = {"lower-topk": "strategy", "lower-dispatch": "quantize", "schedule-experts": "order",
                                "schedule-shared": "most_rows"}
"""The pass options the driver may be given as `auto` and resolves by the cost model
(tcpc/autotune.py): lower-topk's strategy, where lower-dispatch quantizes block-scaled
activations, schedule-experts' loop order, schedule-shared's largest row block."""


def is_auto(p: ModulePass) -> bool:
    """Whether `p` leaves an option to the cost model (`AUTO_OPTIONS`)."""
    option = AUTO_OPTIONS.get(p.name)
    return option is not None and getattr(p, option, None) == "auto"


def mesh_pipeline_spec(ep: int, dp: int, tp: int, strategy: str, topk: str | None, cost_only: bool = False,
                       level: str | None = "scheduled", chunks: int = 1, sp: int = 1, sp_sum: str = "f32",
                       waves: int = 1) -> str:
    """A mesh chip's pipeline: shard-experts over the mesh (its token loop in `chunks`, a2a's
    split pairs returned in `waves`), then
    (unless `level` is None) the single-chip lowering up to `level`, lower-topk's strategy
    `topk` (None: the pass's default), after the cost-only passes when `cost_only`."""
    shard = (f"shard-experts{{ep={ep} dp={dp} tp={tp} strategy={strategy}" + (f" chunks={chunks}" if chunks > 1 else "")
             + (f" sp={sp}" if sp > 1 else "") + (f" sp_sum={sp_sum}" if sp_sum != "f32" else "")
             + (f" waves={waves}" if waves > 1 else "") + "}")
    lowering = pipeline_spec(LEVELS[level], topk_strategy=topk) if level is not None else ""
    return ",".join(p for p in (*COST_ONLY_PASSES[:len(COST_ONLY_PASSES) * cost_only], shard, lowering) if p)


def make_context() -> Context:
    ctx = Context()
    for dialect in DIALECTS:
        ctx.load_dialect(dialect)
    return ctx


class PipelineError(ValueError):
    """A `-p` pipeline that cannot be parsed or built; the message quotes the pipeline and
    says where and what is wrong, on one line."""

    def __init__(self, spec: str, message: str, column: int | None = None):
        where = f" at column {column}" if column is not None else ""
        super().__init__(f"pipeline '{spec}': {message}{where}")


def check_pipeline_syntax(spec: str) -> None:
    """Catch the slips xDSL's pipeline parser accepts or reports with a multi-line message (or
    a BaseException): an empty pass between commas, before the first or after the last, an
    unclosed brace, an option given twice, a character the pipeline syntax has no use for."""
    lexer = PipelineLexer(spec)
    tokens = []
    try:
        while not tokens or tokens[-1].kind is not SpecTokenKind.EOF:
            tokens.append(lexer.lex())
    except ArgSpecParseError as e:
        column = _column(e)
        bad = spec[column - 1] if column is not None and column <= len(spec) else "?"
        raise PipelineError(spec, f"unexpected character {bad!r}", column) from None
    open_brace: int | None = None
    options: set[str] = set()
    expect_pass = True
    after_name = False
    for i, token in enumerate(tokens):
        kind, column = token.kind, token.span.start + 1
        if open_brace is not None:
            if kind is SpecTokenKind.R_BRACE:
                open_brace = None
            elif kind is SpecTokenKind.EOF:
                raise PipelineError(spec, "'{' is never closed", open_brace)
            elif kind is SpecTokenKind.IDENT and tokens[i - 1].kind in (SpecTokenKind.L_BRACE, SpecTokenKind.SPACE):
                if token.span.text in options:
                    raise PipelineError(spec, f"option '{token.span.text}' is given twice", column)
                options.add(token.span.text)
            continue
        if kind is SpecTokenKind.SPACE:
            raise PipelineError(spec, "a space outside '{...}' (passes are separated by ',' alone)", column)
        if kind is SpecTokenKind.COMMA or (kind is SpecTokenKind.EOF and i > 0):
            if expect_pass:
                raise PipelineError(spec, "a pass name is missing (two commas, or a comma at an end)", column)
            expect_pass, after_name = True, False
        elif kind is SpecTokenKind.IDENT and expect_pass:
            expect_pass, after_name = False, True
        elif kind is SpecTokenKind.L_BRACE and after_name:
            open_brace, options, after_name = column, set(), False
        elif kind is SpecTokenKind.R_BRACE:
            raise PipelineError(spec, "'}' without a '{'", column)
        elif kind is not SpecTokenKind.EOF:
            expected = "a pass name" if expect_pass else "',' or '{'"
            raise PipelineError(spec, f"unexpected '{token.span.text}', expected {expected}", column)


def _column(e: ArgSpecParseError) -> int | None:
    """The column xDSL's message gives (`pass-pipeline:1:COLUMN`), if any."""
    for line in str(e).splitlines():
        if line.startswith("pass-pipeline:"):
            try:
                return int(line.rsplit(":", 1)[1])
            except ValueError:
                return None
    return None


def parse_pipeline(spec: str) -> list[ModulePass]:
    """Parse `a,b{opt=1}` into pass instances; every mistake (syntax, an unknown pass, a bad
    option) raises PipelineError with a one-line message."""
    if not spec.strip():
        return []
    check_pipeline_syntax(spec)
    try:
        return list(PassPipeline.parse_spec(PASSES, spec).passes)
    except ArgSpecParseError as e:  # a BaseException in xDSL: catch it by name
        message = str(e).strip().splitlines()[-1].strip()
        raise PipelineError(spec, message[0].lower() + message[1:], _column(e)) from None
    except ValueError as e:
        text = str(e)
        if text.startswith("Unrecognized passes"):
            unknown = text.split("[", 1)[1].rstrip("]")
            noun = "pass" if "," not in unknown else "passes"
            raise PipelineError(spec, f"unknown {noun} {unknown} (known: {', '.join(PASSES)})") from None
        raise PipelineError(spec, text) from None
    except Exception as e:  # xDSL reports bad option values with plain exceptions
        raise PipelineError(spec, str(e)) from None


@dataclass(frozen=True)
class PassStep:
    """One step of a pipeline as `apply_pipeline` ran it, for whatever watches it
    (`--print-ir-after-all`, `--dump-ir`, `--time-passes`, `--pass-stats`, tcpc/pass_instruments.py):
    step 0 is the IR the first pass is given, step i the IR after the i-th pass."""

    index: int
    module: ModuleOp
    """The pipeline's own copy of the IR, which the next pass rewrites in place: read it or clone it."""
    pass_: ModulePass | None = None
    """The pass of this step; None for step 0."""
    seconds: float = 0.0
    """The pass's wall time (its `apply`)."""
    verify_seconds: float = 0.0
    """The wall time of verifying the IR after it."""

    @property
    def name(self) -> str:
        """The pass's name; `input` for step 0."""
        return "input" if self.pass_ is None else self.pass_.name


VERIFY_MODES = ("each", "last", "none")
"""When apply_pipeline verifies the IR: after each pass (a compile whose IR a user sees), after
the last one only, or never (a candidate a choice of the cost model compiles, costs and drops:
tcpc/autotune.py verifies the one it keeps before handing it over)."""


def apply_pipeline(module: ModuleOp, passes: list[ModulePass],
                   after_each: Callable[[PassStep], None] | None = None,
                   machine: Machine | None = None, verify: str = "each") -> ModuleOp:
    """Apply passes to a clone of `module`, verifying as `verify` says (VERIFY_MODES), the ops
    each creates located where the ops they lower were (tcpc/provenance.py); with `machine`, the
    clone targets it (its `dlti.target_system_spec`, which every pass reads), whatever target
    `module` had; without, the passes compile for `module`'s target (or the default machine).
    `after_each` sees every step: the clone before the first pass, then the IR after each
    pass, with the pass's time (outside the timed region, so what it does costs no pass time)."""
    assert verify in VERIFY_MODES, verify
    ctx = make_context()
    with without_gc_pauses():  # the module grows by thousands of ops, which the collector would rescan
        lowered = module.clone()
        if machine is not None:
            attach(lowered, machine)
        verified = Verified()
        if after_each is not None:
            after_each(PassStep(0, lowered))
        locating = Locating(lowered)
        for index, p in enumerate(passes, 1):
            with locating.inherited(p.name):
                start = time.perf_counter()
                p.apply(ctx, lowered)
                applied = time.perf_counter()
            if verify == "each" or (verify == "last" and index == len(passes)):
                verify_changed(lowered, verified)
            if after_each is not None:
                after_each(PassStep(index, lowered, p, applied - start, time.perf_counter() - applied))
    return lowered


@dataclass
class Verified:
    """What `verify_changed` has checked in one pipeline: the contents (`_content`) of the ops
    it verified, since any op of one of them verifies alike, and each op's mark (`_mark`, by
    the op's id: a mark holds its op, so the id is not reused meanwhile) as it was when last
    checked, since an op whose mark has not changed verifies as it did."""

    contents: set[tuple[object, ...]] = field(default_factory=set)
    marks: dict[int, tuple[object, ...] | None] = field(default_factory=dict)


def verify_changed(op: Operation, verified: Verified) -> None:
    """`op.verify()`, skipping what `verified` shows unchanged: an op, with everything nested
    in it, whose mark (`_mark`) is the one it had when last checked (a `ve.chain` or a
    `func.func` a pass left as it was), and an op without regions whose content (`_content`)
    is one verified (a loop's body repeats the same ops); the marks are then the ops' now.
    After each pass of a pipeline only the ops it made or changed are verified again. The
    checks are xDSL's Operation.verify's: an op's regions (parent pointers, a block that lacks
    its terminator, every op in them), then the op itself."""
    marks: dict[int, tuple[object, ...] | None] = {}
    _mark(op, marks, verified.marks)  # `op` itself is always verified: its place is not needed
    _verify_marked(op, verified, marks)
    verified.marks = marks  # the ops of now only: those a pass erased are let go


def _verify_marked(op: Operation, verified: Verified, marks: Mapping[int, tuple[object, ...] | None]) -> None:
    for region in op.regions:
        for block in region.blocks:
            for child in block.ops:
                if child.parent is not block:
                    raise ValueError("Parent pointer of operation does not refer to containing region")
                mark = marks[id(child)]
                if mark is not None and verified.marks.get(id(child)) is mark:  # `_mark` kept it: unchanged
                    continue
                content = _content(child, mark) if not child.regions else _isolated_content(child, mark)
                if content is None or content not in verified.contents:
                    _verify_marked(child, verified, marks)
                    if content is not None:
                        verified.contents.add(content)
            if block.first_op is None and len(region.blocks) == 1 and not op.has_trait(NoTerminator):
                raise VerifyException(f"Operation {op.name} contains empty block in single-block region that "
                                      "expects at least a terminator")
            if block.parent is not region:
                raise ValueError("Parent pointer of block does not refer to containing region")
    op.verify(verify_nested_ops=False)


def _mark(op: Operation, marks: dict[int, tuple[object, ...] | None], before: Mapping[int, tuple[object, ...] | None],
          place: tuple[object, ...] = ()) -> tuple[object, ...] | None:
    """Everything verifying `op` and the ops nested in it reads, by identity (so comparing two
    marks of an unchanged op compares the same objects): the op, the values it reads and their
    types, its result types, attributes and properties, its `place` (its parent's kind, its
    region's number of blocks, whether it ends its block), its successors and its regions'
    blocks (their argument types and ops' marks, in order); None when that is not all (a trait
    that checks other ops, as a symbol user's does). Stored in `marks` for `op` and every op
    nested in it; the mark `before` holds for the op when it is equal (so only a changed op's
    mark is a new object, and an unchanged one is told by identity). An erased operand needs
    no care: the op that read the value reads another since."""
    inner: list[object] = []
    within = _verifies_within(type(op))
    for region in op.regions:
        blocks = list(region.blocks)
        for block in blocks:
            last = block.last_op
            here, ends = (type(op), len(blocks), False), (type(op), len(blocks), True)
            ops = tuple(_mark(child, marks, before, ends if child is last else here) for child in block.ops)
            within = within and None not in ops
            inner.append((block.arg_types, ops))
    operands = tuple(op.operands)
    mark = (op, operands, tuple(v.type for v in operands), tuple(r.type for r in op.results),
            tuple(chain.from_iterable(op.attributes.items())), tuple(chain.from_iterable(op.properties.items())),
            place, tuple(op.successors), tuple(inner)) if within else None  # names and values flat: fewer objects held
    if mark is not None and (kept := before.get(id(op))) == mark:
        mark = kept
    marks[id(op)] = mark
    return mark


def _content(op: Operation, mark: tuple[object, ...] | None) -> tuple[object, ...] | None:
    """Everything verifying `op` reads, when that is the op alone (its operand and result
    types, attributes, properties, and its parent's kind), from its `_mark`; None when
    verifying it reads more: an op with regions or successors, the last op of a block
    (terminator rules), one with a trait that checks other ops (a symbol user, an isolated
    region) or an erased operand."""
    if mark is None or op.regions or op.successors or not _self_contained(type(op)):
        return None
    _, operands, operand_types, result_types, attributes, properties, place, _, _ = mark
    if not place or place[2] or any(isinstance(v, ErasedSSAValue) for v in operands):  # type: ignore[union-attr]
        return None
    return (type(op), operand_types, result_types, attributes, properties, place[0])  # type: ignore[index]


def _isolated_content(op: Operation, mark: tuple[object, ...] | None) -> tuple[object, ...] | None:
    """Everything verifying `op` and the ops in it reads, when `op` is isolated from above and
    holds one block of ops without regions (a `ve.chain`): `_content`'s of each, with the
    values they read as places in the block, from its `_mark`; None for any other op. Chains
    of the same ops verify alike, as ops of the same content do."""
    if mark is None or not op.has_trait(IsolatedFromAbove) or len(op.regions) != 1:
        return None
    _, _, operand_types, result_types, attributes, properties, place, successors, inner = mark
    if successors or len(inner) != 1:  # type: ignore[arg-type]
        return None
    ((arg_types, ops),) = inner  # type: ignore[misc]
    block = op.regions[0].block
    where: dict[SSAValue, tuple[int, int]] = {a: (-1, a.index) for a in block.args}
    body: list[tuple[object, ...]] = []
    for i, (inner_op, operands, _, types, attrs, props, at, _, nested) in enumerate(ops):
        if nested:
            return None
        where.update((r, (i, r.index)) for r in inner_op.results)
        body.append((type(inner_op), tuple(where.get(v, v) for v in operands), types, attrs, props, at))
    return (type(op), operand_types, result_types, attributes, properties, place, arg_types, tuple(body))


_ALONE: tuple[type[OpTrait], ...] = (HasParent, HasFolder)
"""Traits whose checks read no more than an op and its parent's kind (HasFolder: xDSL's folder
interface, arith's, checks nothing)."""
_WITHIN: tuple[type[OpTrait], ...] = (*_ALONE, IsTerminator, ReturnLike, IsolatedFromAbove, NoTerminator,
                                      SingleBlockImplicitTerminator, SymbolTable, SymbolOpInterface)
"""Traits whose checks read no more than an op, its parent's kind, its place in its block and
the ops nested in it (OptionalSymbolOpInterface is a SymbolOpInterface)."""
_VERIFIES_WITHIN: dict[type[Operation], bool] = {}
_SELF_CONTAINED: dict[type[Operation], bool] = {}


def _checks_only(cls: type[Operation], traits: tuple[type[OpTrait], ...], known: dict[type[Operation], bool]) -> bool:
    """Whether every trait of `cls` checks nothing (OpTrait's own verify) or is one of `traits`
    (remembered in `known`)."""
    found = known.get(cls)
    if found is None:
        found = known[cls] = all(isinstance(t, traits) or type(t).verify is OpTrait.verify for t in cls.traits)
    return found


def _verifies_within(cls: type[Operation]) -> bool:
    """Whether `cls`'s traits check no more than `_WITHIN`'s."""
    return _checks_only(cls, _WITHIN, _VERIFIES_WITHIN)


def _self_contained(cls: type[Operation]) -> bool:
    """Whether `cls`'s traits check no more than `_ALONE`'s (its parent's kind, which
    `_content` keys on)."""
    return _checks_only(cls, _ALONE, _SELF_CONTAINED)
