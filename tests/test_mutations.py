"""Mutated example programs (tokens deleted, inserted, swapped; numbers changed, also to sizes
and literals no type can hold) compile, or fail with a located CompileError: never another
exception, never a hang. Graph-level compile only, at the examples' own small dims, with their
`B = auto` written `B = 4`: a block left to the compiler would cost a search (compiles and
simulations) per mutant, which is not the frontend."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tcpc.diagnostics import CompileError
from tcpc.program import compile_source

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.moe"))
SOURCES = [p.read_text().replace("B = auto", "B = 4") for p in EXAMPLES]
TOKEN = re.compile(r"\s+|#[^\n]*|[A-Za-z_]\w*|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\"[^\"\n]*\"|\S")
NUMBER = re.compile(r"\d")
EXTRA = ["(", ")", "[", "]", "{", "}", ",", "=", "-", "*", "/", "@", "_", "inf", "true", '"index"', "...",
         "return", "graph", "dims", "auto", "f32", "bf16", "i32", "0", "-1", "1.5", "1e999", "3000000000"]
"""Tokens worth inserting besides the program's own."""
NUMBERS = st.one_of(
    st.integers(-3, 70),
    st.sampled_from([0, 2**31 - 1, 2**31, 2**40, 2**63, 10**400]),
    st.sampled_from(["1e999", "1.0e39", "3.4e38", "0.5", "1e-50"]),
)


@st.composite
def mutated(draw: st.DrawFn) -> str:
    tokens = TOKEN.findall(draw(st.sampled_from(SOURCES)))
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(tokens) - 1))
        kind = draw(st.sampled_from(["delete", "insert", "swap", "number"]))
        if kind == "delete":
            del tokens[i]
        elif kind == "insert":
            tokens.insert(i, draw(st.sampled_from(EXTRA + tokens)))
        elif kind == "swap":
            j = draw(st.integers(0, len(tokens) - 1))
            tokens[i], tokens[j] = tokens[j], tokens[i]
        else:
            numbers = [k for k, t in enumerate(tokens) if NUMBER.match(t)]
            if numbers:
                tokens[draw(st.sampled_from(numbers))] = str(draw(NUMBERS))
    return "".join(tokens)


def test_every_example_tokenizes_back_to_itself() -> None:
    assert all("".join(TOKEN.findall(s)) == s for s in SOURCES)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_programs_compile_or_fail_located(source: str) -> None:
    try:
        compile_source(source, filename="mutant.moe")
    except CompileError as e:
        assert e.loc is not None, e.message
        rendered = e.render("mutant.moe", source)
        assert rendered.startswith(f"mutant.moe:{e.loc.line}:{e.loc.col}: error: ")
