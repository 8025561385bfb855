"""The .moe abstract syntax tree; every node keeps its source location for diagnostics."""

from __future__ import annotations

from dataclasses import dataclass, field

from tcpc.diagnostics import Loc


@dataclass(frozen=True)
class Expr:
    loc: Loc


@dataclass(frozen=True)
class Number(Expr):
    value: int | float


@dataclass(frozen=True)
class String(Expr):
    value: str


@dataclass(frozen=True)
class Auto(Expr):
    """`auto`: a value the compiler picks by its cost model (`scatter(..., block=auto)`)."""


@dataclass(frozen=True)
class Name(Expr):
    id: str


@dataclass(frozen=True)
class Keyword:
    name: str
    value: Expr
    loc: Loc


@dataclass(frozen=True)
class Call(Expr):
    func: str
    args: tuple[Expr, ...]
    keywords: tuple[Keyword, ...]


@dataclass(frozen=True)
class Convert(Expr):
    """`f32(x)`, `bf16(x)`, `i32(x)`: the explicit element-type conversions."""

    dtype: str
    operand: Expr


@dataclass(frozen=True)
class ListExpr(Expr):
    items: tuple[Expr, ...]


@dataclass(frozen=True)
class TupleExpr(Expr):
    """`(a, b)`: several values as one argument (`scales=(xs, ws)`)."""

    items: tuple[Expr, ...]


@dataclass(frozen=True)
class Neg(Expr):
    operand: Expr


@dataclass(frozen=True)
class Binary(Expr):
    op: str
    lhs: Expr
    rhs: Expr


@dataclass(frozen=True)
class TensorTypeExpr:
    dtype: str
    dims: tuple[Expr, ...]
    loc: Loc


@dataclass(frozen=True)
class Param:
    name: str
    type: TensorTypeExpr
    loc: Loc


@dataclass(frozen=True)
class Assign:
    targets: tuple[Name, ...]
    value: Expr
    loc: Loc


@dataclass(frozen=True)
class Return:
    values: tuple[Expr, ...]
    loc: Loc


@dataclass(frozen=True)
class Graph:
    name: str
    params: tuple[Param, ...]
    results: tuple[TensorTypeExpr, ...]
    body: tuple[Assign | Return, ...]
    loc: Loc


@dataclass(frozen=True)
class DimDef:
    name: str
    value: Expr
    loc: Loc


@dataclass(frozen=True)
class Program:
    dims: tuple[DimDef, ...] = ()
    graphs: tuple[Graph, ...] = field(default=())
