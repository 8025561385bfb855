"""Numpy semantics of the `lowp` ops, by `quantization`'s one definition."""

from __future__ import annotations

from typing import Any

import numpy as np
from xdsl.interpreter import Interpreter, InterpreterFunctions, impl, register_impls

from dialects import lowp
from runtime_sim.semantics.numerics import round_to, tensor_dtype
from runtime_sim.semantics.quantization import dequantize, quantize, scaled_contract


@register_impls
class LowpFunctions(InterpreterFunctions):
    @impl(lowp.QuantizeOp)
    def run_quantize(self, interpreter: Interpreter, op: lowp.QuantizeOp, args: tuple[Any, ...]):
        return quantize(args[0], tensor_dtype(op.values.type), op.group_size)

    @impl(lowp.DequantizeOp)
    def run_dequantize(self, interpreter: Interpreter, op: lowp.DequantizeOp, args: tuple[Any, ...]):
        values, scales, *rest = args
        optional = iter(rest)
        grid, su, sv = (None if v is None else next(optional) for v in (op.grid, op.su, op.sv))
        return (dequantize(values, scales, op.block_shape, grid, su, sv),)

    @impl(lowp.ScaledMatmulOp)
    def run_scaled_matmul(self, interpreter: Interpreter, op: lowp.ScaledMatmulOp, args: tuple[Any, ...]):
        x, w, xs, ws = (np.asarray(a) for a in args)
        out = scaled_contract(x[None], xs[None], w[None], ws[None])[0]
        return (round_to(out, tensor_dtype(op.result.type)),)
