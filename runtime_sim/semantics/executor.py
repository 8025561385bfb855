"""Run a function of a tcpc module on numpy values with xDSL's interpreter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.interpreter import Interpreter, InterpreterFunctions
from xdsl.interpreters.arith import ArithFunctions
from xdsl.interpreters.func import FuncFunctions
from xdsl.interpreters.scf import ScfFunctions

from runtime_sim.semantics.lowp_semantics import LowpFunctions
from runtime_sim.semantics.moe_semantics import MoEFunctions
from runtime_sim.semantics.tcp_semantics import TCPFunctions
from runtime_sim.semantics.tile_semantics import TileFunctions
from runtime_sim.semantics.tmath_semantics import TMathFunctions
from runtime_sim.semantics.ve_semantics import VEFunctions

SEMANTICS: list[type[InterpreterFunctions]] = [
    FuncFunctions,
    TMathFunctions,
    MoEFunctions,
    VEFunctions,
    TCPFunctions,
    ScfFunctions,
    ArithFunctions,
    TileFunctions,
    LowpFunctions,
]
"""Every dialect's numpy semantics; each lowering level registers its own here."""


def make_interpreter(module: ModuleOp, listeners: Sequence[Interpreter.Listener] = ()) -> Interpreter:
    """`listeners` see every op as it runs (the simulator costs ops through one; cost-only mode
    registers shape-only implementations over these, runtime_sim/perf/cost_only.py)."""
    interpreter = Interpreter(module, listeners=tuple(listeners))
    for functions in SEMANTICS:
        interpreter.register_implementations(functions())
    return interpreter


def run_function(module: ModuleOp, name: str, args: Sequence[np.ndarray],
                 listeners: Sequence[Interpreter.Listener] = ()) -> tuple[Any, ...]:
    """Call `name` with arguments already in their declared dtypes; floating-point exceptions
    (overflow to inf, 0/0) follow IEEE quietly, as the hardware does."""
    interpreter = make_interpreter(module, listeners)
    with np.errstate(all="ignore"):
        return tuple(interpreter.call_op(name, tuple(args)))


def function_named(module: ModuleOp, name: str) -> func.FuncOp:
    for op in module.ops:
        if isinstance(op, func.FuncOp) and op.sym_name.data == name:
            return op
    raise KeyError(name)
