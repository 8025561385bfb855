"""The dialects and passes tcpc knows, and its named pipelines.

Every pass registers here once; `tcpc`, `tcpc-opt` and the Python API all read this table.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from xdsl.context import Context
from xdsl.dialects import arith, func, scf
from xdsl.dialects.builtin import Builtin, ModuleOp
from xdsl.ir import Dialect
from xdsl.passes import ModulePass, PassPipeline

from dialects.ccl import CCL
from dialects.moe import MoE
from dialects.tcp import TCP
from dialects.tile import Tile
from dialects.tmath import TMath
from dialects.ve import VE

DIALECTS: list[Dialect] = [Builtin, func.Func, TMath, MoE, VE, TCP, Tile, scf.Scf, arith.Arith, CCL]


def _lazy(module: str, name: str) -> Callable[[], type[ModulePass]]:
    """A factory that imports the pass only when a pipeline asks for it."""

    def load() -> type[ModulePass]:
        return getattr(importlib.import_module(module), name)

    return load


PASSES: dict[str, Callable[[], type[ModulePass]]] = {
    "lower-topk": _lazy("passes.lower_topk", "LowerTopKPass"),
    "lower-routing": _lazy("passes.lower_routing", "LowerRoutingPass"),
    "lower-dispatch": _lazy("passes.lower_dispatch", "LowerDispatchPass"),
    "lower-math": _lazy("passes.lower_math", "LowerMathPass"),
    "load-arguments": _lazy("passes.load_arguments", "LoadArgumentsPass"),
    "pin-routing": _lazy("passes.pin_routing", "PinRoutingPass"),
    "schedule-experts": _lazy("passes.schedule_experts", "ScheduleExpertsPass"),
    "schedule-tokens": _lazy("passes.schedule_tokens", "ScheduleTokensPass"),
    "shard-experts": _lazy("passes.shard_experts", "ShardExpertsPass"),
}
"""Pass name -> factory of the pass class, as xDSL's pipeline parser wants them."""

LOWERED_PIPELINE: tuple[str, ...] = (
    "lower-topk", "lower-routing", "lower-dispatch", "lower-math", "load-arguments",
)
"""The full lowering, in order: after it the IR holds only func, tcp, ve and builtin ops, each
working on whole tensors."""

SCHEDULE_PIPELINE: tuple[str, ...] = ("schedule-experts", "schedule-tokens")
"""The schedule level, after the lowering: static loops over blocks and token tiles whose
tiles fit SRAM, weights loaded once per expert and prefetched (docs: README, "The schedule
level")."""

FULL_PIPELINE: tuple[str, ...] = LOWERED_PIPELINE + SCHEDULE_PIPELINE
"""What `tcpc run` simulates and `--emit scheduled` prints."""


def make_context() -> Context:
    ctx = Context()
    for dialect in DIALECTS:
        ctx.load_dialect(dialect)
    return ctx


def parse_pipeline(spec: str) -> list[ModulePass]:
    """Parse `a,b{opt=1}` into pass instances; unknown names raise ValueError."""
    if not spec.strip():
        return []
    return list(PassPipeline.parse_spec(PASSES, spec).passes)


def apply_pipeline(module: ModuleOp, passes: list[ModulePass],
                   after_each: Callable[[ModulePass, ModuleOp], None] | None = None) -> ModuleOp:
    """Apply passes to a clone of `module`, verifying after each one."""
    ctx = make_context()
    lowered = module.clone()
    for p in passes:
        p.apply(ctx, lowered)
        lowered.verify()
        if after_each is not None:
            after_each(p, lowered)
    return lowered
