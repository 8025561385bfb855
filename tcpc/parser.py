"""Parse .moe text into the AST of `tcpc.syntax` with lark (LALR), keeping source locations."""

from __future__ import annotations

import math
from functools import cache
from importlib.resources import files

import lark
from lark import Lark, Token, Transformer, v_args

from tcpc import syntax as ast
from tcpc.diagnostics import CompileError, Loc

TOKEN_NAMES = {
    "NAME": "a name",
    "NUMBER": "a number",
    "STRING": "a string",
    "DTYPE": "a type (bf16, f32, i32)",
    "_DIMS": "'dims'",
    "_GRAPH": "'graph'",
    "_RETURN": "'return'",
    "AUTO": "'auto'",
    "$END": "end of file",
}
EXPRESSION_START = {"LPAR", "MINUS", "LSQB", "NAME", "NUMBER", "STRING", "DTYPE", "AUTO"}
"""The terminals an expression can start with: when all are expected, say "an expression"."""
OPERATORS = {"ADD_OP", "MUL_OP", "COMP_OP"}


@cache
def _lark() -> Lark:
    grammar = files("tcpc").joinpath("moe.lark").read_text()
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True)


def _loc(item: Token | lark.tree.Meta) -> Loc:
    return Loc(item.line, item.column)


def _number(text: str) -> int | float:
    return int(text) if text.isdigit() else float(text)


@v_args(meta=True)
class _ToAst(Transformer):
    def start(self, meta, items):
        dims = tuple(d for item in items if isinstance(item, list) for d in item)
        graphs = tuple(item for item in items if isinstance(item, ast.Graph))
        return ast.Program(dims, graphs)

    def dims(self, meta, items):
        return list(items)

    def dim_def(self, meta, items):
        name, value = items
        return ast.DimDef(str(name), value, _loc(name))

    def graph(self, meta, items):
        name, *rest = items
        params = tuple(i for i in rest if isinstance(i, ast.Param))
        results = next(i for i in rest if isinstance(i, tuple))
        body = tuple(i for i in rest if isinstance(i, ast.Assign | ast.Return))
        return ast.Graph(str(name), params, results, body, _loc(name))

    def param(self, meta, items):
        name, type_ = items
        return ast.Param(str(name), type_, _loc(name))

    def results(self, meta, items):
        return tuple(items)

    def tensor_type(self, meta, items):
        dtype, *dims = items
        return ast.TensorTypeExpr(str(dtype), tuple(d for d in dims if d is not None), _loc(dtype))

    def assign(self, meta, items):
        *targets, value = items
        return ast.Assign(tuple(targets), value, _loc(meta))

    def target(self, meta, items):
        return ast.Name(_loc(items[0]), str(items[0]))

    def return_stmt(self, meta, items):
        return ast.Return(tuple(items), _loc(meta))

    def binary(self, meta, items):
        lhs, op, rhs = items
        return ast.Binary(_loc(op), str(op), lhs, rhs)

    def neg(self, meta, items):
        return ast.Neg(_loc(meta), items[0])

    def number(self, meta, items):
        value = _number(str(items[0]))
        if isinstance(value, float) and not math.isfinite(value):
            raise CompileError(f"the number {items[0]} is not finite (it overflows a 64-bit float); write inf for infinity", _loc(items[0]))
        return ast.Number(_loc(items[0]), value)

    def string(self, meta, items):
        return ast.String(_loc(items[0]), str(items[0])[1:-1])

    def name(self, meta, items):
        return ast.Name(_loc(items[0]), str(items[0]))

    def call(self, meta, items):
        name, *args = items
        args = [a for a in args if a is not None]
        for before, after in zip(args, args[1:]):
            if isinstance(before, ast.Keyword) and not isinstance(after, ast.Keyword):
                raise CompileError("positional argument after a keyword argument", after.loc)
        positional = tuple(a for a in args if not isinstance(a, ast.Keyword))
        keywords = tuple(a for a in args if isinstance(a, ast.Keyword))
        return ast.Call(_loc(name), str(name), positional, keywords)

    def keyword(self, meta, items):
        name, value = items
        return ast.Keyword(str(name), value, _loc(name))

    def convert(self, meta, items):
        dtype, operand = items
        return ast.Convert(_loc(dtype), str(dtype), operand)

    def type_name(self, meta, items):
        """An element type named as a value, `quantize(x, f8e4m3, ...)`: its name as a string."""
        return ast.String(_loc(items[0]), str(items[0]))

    def auto(self, meta, items):
        return ast.Auto(_loc(items[0]))

    def tuple(self, meta, items):
        return ast.TupleExpr(_loc(meta), tuple(items))

    def list(self, meta, items):
        return ast.ListExpr(_loc(meta), tuple(i for i in items if i is not None))


def _describe(token_type: str) -> str:
    if token_type in TOKEN_NAMES:
        return TOKEN_NAMES[token_type]
    try:
        pattern = _lark().get_terminal(token_type).pattern.value
    except KeyError:
        return token_type
    return f"'{pattern}'"


def _expected(source: str, pos: int | None) -> str:
    """What the parser accepts just before offset `pos` (None: at the end of the input), in words.

    The error an LALR parser raises comes after it has reduced on the bad token and so lost
    choices such as operators; replaying the tokens before it gives the exact set.
    """
    parser = _lark().parse_interactive(source)
    try:
        for token in parser.iter_parse():
            if pos is not None and token.start_pos >= pos:
                break
    except lark.exceptions.UnexpectedInput:
        pass
    types = set(parser.accepts())
    words = []
    if EXPRESSION_START <= types:
        types -= EXPRESSION_START
        words.append("an expression")
    if types & OPERATORS:
        types -= OPERATORS
        words.append("an operator")
    words += sorted(_describe(t) for t in types)
    if len(words) > 8:
        words = words[:7] + ["..."]
    return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else "".join(words)


def _end_of_file(source: str) -> Loc:
    """Just after the last character that is not white space."""
    lines = source.rstrip().split("\n")
    return Loc(len(lines), len(lines[-1]) + 1)


BOM = "\ufeff"
"""The byte-order mark some editors write at the start of a UTF-8 file: not part of the program."""


def parse(source: str) -> ast.Program:
    """Parse a whole .moe file; syntax errors become located `CompileError`s."""
    source = source.removeprefix(BOM)
    try:
        tree = _lark().parse(source)
    except lark.exceptions.UnexpectedCharacters as e:
        char = source[e.pos_in_stream]
        message = "unterminated string" if char == '"' else f"unexpected character {char!r}"
        raise CompileError(message, Loc(e.line, e.column)) from None
    except lark.exceptions.UnexpectedEOF:
        raise CompileError(f"unexpected end of file, expected {_expected(source, None)}", _end_of_file(source)) from None
    except lark.exceptions.UnexpectedToken as e:
        if e.token.type == "$END":
            raise CompileError(f"unexpected end of file, expected {_expected(source, None)}", _end_of_file(source)) from None
        expected = _expected(source, e.token.start_pos)
        raise CompileError(f"unexpected {e.token.value!r}, expected {expected}", Loc(e.line, e.column)) from None
    try:
        return _ToAst().transform(tree)
    except lark.exceptions.VisitError as e:
        if isinstance(e.orig_exc, CompileError):
            raise e.orig_exc from None
        raise
