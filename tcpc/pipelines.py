"""The dialects and passes tcpc knows, and its named pipelines.

Every pass registers here once; `tcpc`, `tcpc-opt` and the Python API all read this table.
"""

from __future__ import annotations

from collections.abc import Callable

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import Builtin, ModuleOp
from xdsl.ir import Dialect
from xdsl.passes import ModulePass, PassPipeline

from dialects.moe import MoE
from dialects.tcp import TCP
from dialects.tmath import TMath
from dialects.ve import VE

DIALECTS: list[Dialect] = [Builtin, func.Func, TMath, MoE, VE, TCP]


def _lower_topk() -> type[ModulePass]:
    from passes.lower_topk import LowerTopKPass

    return LowerTopKPass


def _lower_math() -> type[ModulePass]:
    from passes.lower_math import LowerMathPass

    return LowerMathPass


def _passes() -> dict[str, Callable[[], type[ModulePass]]]:
    return {"lower-topk": _lower_topk, "lower-math": _lower_math}


PASSES: dict[str, Callable[[], type[ModulePass]]] = _passes()
"""Pass name -> factory of the pass class, as xDSL's pipeline parser wants them."""

LOWERED_PIPELINE: tuple[str, ...] = ()
"""The passes of `--emit lowered`, in order; empty until the lowering passes exist."""


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
