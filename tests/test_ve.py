"""The `ve` dialect: numpy semantics of each op, including the branch-logger cumsum of the
routing design and filter compaction with padding (its assembly round trips and verifier
messages are tests/filecheck/dialects/ve/)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from xdsl.dialects.builtin import ModuleOp
from xdsl.parser import Parser

from runtime_sim.semantics.executor import run_function
from tcpc.pipelines import make_context


def parse(text: str) -> ModuleOp:
    module = Parser(make_context(), text).parse_module()
    module.verify()
    return module


def single(body: str, args: str, results: str) -> ModuleOp:
    return parse(f"func.func @f({args}) -> ({results}) {{\n{body}\n}}")


def run(body: str, args: str, results: str, *values: np.ndarray) -> tuple[np.ndarray, ...]:
    return run_function(single(body, args, results), "f", list(values))


def cumsum_ir(shape: str, axis: int) -> str:
    """The routing design's cumsum: a static branch log and one guarded add."""
    return (
        f"%p = ve.position_tag along {axis} first 0 middle 1 last 2 single 3 : tensor<{shape}xi4>\n"
        f"%s = ve.scan add %x, %p along {axis} read [1, 2] write [0, 1] : tensor<{shape}xi32>, tensor<{shape}xi4>\n"
        f"%e = ve.sub %s, %x : tensor<{shape}xi32>\n"
        f"func.return %s, %e : tensor<{shape}xi32>, tensor<{shape}xi32>"
    )


@pytest.mark.parametrize("shape, axis", [((5, 7), 1), ((5, 7), 0), ((4, 1), 1), ((1, 3), 0), ((2, 2), 1), ((6,), 0)])
def test_branch_logger_cumsum(shape: tuple[int, ...], axis: int) -> None:
    x = np.random.default_rng(1).integers(-9, 9, size=shape, dtype=np.int32)
    s = "x".join(map(str, shape))
    inclusive, exclusive = run(cumsum_ir(s, axis), f"%x: tensor<{s}xi32>", f"tensor<{s}xi32>, tensor<{s}xi32>", x)
    np.testing.assert_array_equal(inclusive, np.cumsum(x, axis=axis, dtype=np.int32))
    np.testing.assert_array_equal(exclusive, np.cumsum(x, axis=axis, dtype=np.int32) - x)


def test_position_tag_single_element_axis() -> None:
    (tags,) = run("%p = ve.position_tag along 1 first 4 middle 5 last 6 single 7 : tensor<2x1xi4>\n"
                  "func.return %p : tensor<2x1xi4>", "", "tensor<2x1xi4>")
    assert tags.dtype == np.uint8 and tags.tolist() == [[7], [7]]
    (tags,) = run("%p = ve.position_tag along 0 first 4 middle 5 last 6 single 7 : tensor<4x2xi4>\n"
                  "func.return %p : tensor<4x2xi4>", "", "tensor<4x2xi4>")
    assert tags[:, 0].tolist() == [4, 5, 5, 6]


def test_scan_max_register_starts_at_zero() -> None:
    x = np.array([[-3, -1, -2, 5]], dtype=np.int32)
    body = ("%p = ve.position_tag along 1 first 0 middle 1 last 2 single 3 : tensor<1x4xi4>\n"
            "%s = ve.scan max %x, %p along 1 read [0, 1, 2] write [0, 1, 2] : tensor<1x4xi32>, tensor<1x4xi4>\n"
            "func.return %s : tensor<1x4xi32>")
    (out,) = run(body, "%x: tensor<1x4xi32>", "tensor<1x4xi32>", x)
    assert out.tolist() == [[0, 0, 0, 5]]


def test_filter_pads_and_truncates() -> None:
    x = np.array([[10, 11, 12, 13], [20, 21, 22, 23]], dtype=np.int32)
    t = np.array([[0, 1, 0, 1], [1, 1, 1, 0]], dtype=np.uint8)
    body = ("%a = ve.filter %x, %t keep [1] along 1 pad -1 : tensor<2x4xi32>, tensor<2x4xi4> -> tensor<2x3xi32>\n"
            "%b = ve.filter %x, %t keep [1] along 1 pad 0 : tensor<2x4xi32>, tensor<2x4xi4> -> tensor<2x2xi32>\n"
            "%c = ve.filter %x, %t keep [0, 1] along 0 pad 7 : tensor<2x4xi32>, tensor<2x4xi4> -> tensor<3x4xi32>\n"
            "func.return %a, %b, %c : tensor<2x3xi32>, tensor<2x2xi32>, tensor<3x4xi32>")
    a, b, c = run(body, "%x: tensor<2x4xi32>, %t: tensor<2x4xi4>", "tensor<2x3xi32>, tensor<2x2xi32>, tensor<3x4xi32>", x, t)
    assert a.tolist() == [[11, 13, -1], [20, 21, 22]]
    assert b.tolist() == [[11, 13], [20, 21]]
    assert c.tolist() == [[10, 11, 12, 13], [20, 21, 22, 23], [7, 7, 7, 7]]


def test_filter_f32_pad_is_a_bit_pattern() -> None:
    x = np.array([1.0, -0.0, 2.0], dtype=np.float32)
    t = np.array([0, 1, 0], dtype=np.uint8)
    body = ("%a = ve.filter %x, %t keep [1] along 0 pad -4194304 : tensor<3xf32>, tensor<3xi4> -> tensor<2xf32>\n"
            "func.return %a : tensor<2xf32>")
    (a,) = run(body, "%x: tensor<3xf32>, %t: tensor<3xi4>", "tensor<2xf32>", x, t)
    assert a.view(np.uint32).tolist() == [0x80000000, 0xFFC00000]


def test_logic_and_fixed_point() -> None:
    x = np.array([-8, 1, 0x7FFFFFFF, -1], dtype=np.int32)
    s = np.array([1, 31, 1, 33], dtype=np.int32)
    ops = ["and", "or", "xor", "shl", "shr_u", "shr_s", "add", "sub", "mul", "max", "min"]
    body = "\n".join(f"%{o} = ve.{o} %x, %s : tensor<4xi32>" for o in ops)
    body += "\nfunc.return " + ", ".join(f"%{o}" for o in ops) + " : " + ", ".join(["tensor<4xi32>"] * len(ops))
    out = dict(zip(ops, run(body, "%x: tensor<4xi32>, %s: tensor<4xi32>", ", ".join(["tensor<4xi32>"] * len(ops)), x, s)))
    u = x.view(np.uint32).astype(np.uint64)
    amount = s & 31
    assert out["shl"].tolist() == [-16, -2**31, -2, -2]
    assert out["shr_u"].tolist() == [int(v) for v in ((u >> amount.astype(np.uint64)).astype(np.uint32).view(np.int32))]
    assert out["shr_s"].tolist() == [-4, 0, 0x3FFFFFFF, -1]
    assert out["add"].tolist() == [-7, 32, -2**31, 32]  # wraps
    assert out["mul"].tolist() == [-8, 31, 2**31 - 1, -33]
    assert out["and"].tolist() == (x & s).tolist() and out["xor"].tolist() == (x ^ s).tolist()
    assert out["max"].tolist() == np.maximum(x, s).tolist() and out["min"].tolist() == np.minimum(x, s).tolist()


def test_bf16_bits_survive_widen_and_narrow_truncate() -> None:
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)
    body = ("%w = ve.widen %h : tensor<65536xbf16> -> tensor<65536xf32>\n"
            "%n = ve.narrow %w truncate : tensor<65536xf32> -> tensor<65536xbf16>\n"
            "%r = ve.narrow %w : tensor<65536xf32> -> tensor<65536xbf16>\n"
            "func.return %w, %n, %r : tensor<65536xf32>, tensor<65536xbf16>, tensor<65536xbf16>")
    w, n, r = run(body, "%h: tensor<65536xbf16>", "tensor<65536xf32>, tensor<65536xbf16>, tensor<65536xbf16>", every)
    assert np.array_equal(w.view(np.uint32), every.view(np.uint16).astype(np.uint32) << 16)
    assert np.array_equal(n.view(np.uint16), every.view(np.uint16))
    finite = ~np.isnan(every.astype(np.float32))
    assert np.array_equal(r.view(np.uint16)[finite], every.view(np.uint16)[finite])


def test_narrow_rounds_to_nearest_even_as_every_level_does() -> None:
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.4e38, np.nan], dtype=np.float32)
    (r,) = run("%r = ve.narrow %x : tensor<4xf32> -> tensor<4xbf16>\nfunc.return %r : tensor<4xbf16>",
               "%x: tensor<4xf32>", "tensor<4xbf16>", x)
    assert np.array_equal(r.view(np.uint16), x.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_conversions_and_float_ops() -> None:
    x = np.array([2.7, -2.7, np.nan, 3e9, -np.inf], dtype=np.float32)
    body = ("%i = ve.fp_to_fxp %x : tensor<5xf32> -> tensor<5xi32>\n"
            "%f = ve.fxp_to_fp %i : tensor<5xi32> -> tensor<5xf32>\n"
            "%s = ve.sigmoid %x : tensor<5xf32>\n"
            "%d = ve.div %x, %f : tensor<5xf32>\n"
            "func.return %i, %f, %s, %d : tensor<5xi32>, tensor<5xf32>, tensor<5xf32>, tensor<5xf32>")
    i, f, s, d = run(body, "%x: tensor<5xf32>", "tensor<5xi32>, tensor<5xf32>, tensor<5xf32>, tensor<5xf32>", x)
    assert i.tolist() == [2, -2, 0, 2**31 - 1, -2**31]
    assert f.dtype == np.float32 and f[0] == 2.0
    assert s.dtype == np.float32 and abs(s[0] - 1 / (1 + np.exp(-2.7))) < 1e-6
    assert np.isnan(d[2])


def test_fpu_log_sqrt_tanh_are_the_reference_functions() -> None:
    x = np.array([2.5, 0.0, -0.0, -1.0, np.inf, 1e-40], dtype=np.float32)
    body = ("%l = ve.log %x : tensor<6xf32>\n%s = ve.sqrt %x : tensor<6xf32>\n%t = ve.tanh %x : tensor<6xf32>\n"
            "func.return %l, %s, %t : tensor<6xf32>, tensor<6xf32>, tensor<6xf32>")
    got = run(body, "%x: tensor<6xf32>", "tensor<6xf32>, tensor<6xf32>, tensor<6xf32>", x)
    with np.errstate(all="ignore"):
        for g, want in zip(got, (np.log(x), np.sqrt(x), np.tanh(x))):
            assert g.dtype == np.float32 and np.array_equal(g.view(np.uint32), want.view(np.uint32))


def test_tags_select_broadcast_reduce() -> None:
    x = np.array([[3.0, np.nan, -1.0], [0.0, -0.0, 5.0]], dtype=np.float32)
    body = ("%z = ve.const 0.0 : tensor<2x3xf32>\n"
            "%t = ve.tag eq %x, %z : tensor<2x3xf32> -> tensor<2x3xi4>\n"
            "%n = ve.tag ne %x, %x : tensor<2x3xf32> -> tensor<2x3xi4>\n"
            "%one = ve.const 1 : tensor<2x3xi32>\n"
            "%zero = ve.const 0 : tensor<2x3xi32>\n"
            "%s = ve.select %t in [1], %one, %zero : tensor<2x3xi4>, tensor<2x3xi32>\n"
            "%b = ve.broadcast %s along 0 : tensor<2x3xi32> -> tensor<4x2x3xi32>\n"
            "%r = ve.reduce_sum %b along 0 : tensor<4x2x3xi32> -> tensor<2x3xi32>\n"
            "%m = ve.reduce_max %x along 1 : tensor<2x3xf32> -> tensor<2xf32>\n"
            "%q = ve.reduce_min %r along 1 : tensor<2x3xi32> -> tensor<2xi32>\n"
            "%all = ve.reduce_sum %q along 0 : tensor<2xi32> -> tensor<i32>\n"
            "func.return %n, %r, %m, %all : tensor<2x3xi4>, tensor<2x3xi32>, tensor<2xf32>, tensor<i32>")
    n, r, m, total = run(body, "%x: tensor<2x3xf32>", "tensor<2x3xi4>, tensor<2x3xi32>, tensor<2xf32>, tensor<i32>", x)
    assert n.tolist() == [[0, 1, 0], [0, 0, 0]]
    assert r.tolist() == [[0, 0, 0], [4, 4, 0]]
    assert np.isnan(m[0]) and m[1] == 5.0
    assert total.shape == () and int(total) == 0


def test_routing_primitives_express_expert_ids() -> None:
    """The routing design's expert-id expansion: blocks per expert (ceil division by shift),
    their diff against a block range, and filter compaction with -1 padding."""
    counts = np.array([5, 0, 9, 4], dtype=np.int32)  # B = 4: blocks 2, 0, 3, 1
    body = (
        "%b1 = ve.const 3 : tensor<4xi32>\n%sh = ve.const 2 : tensor<4xi32>\n"
        "%n0 = ve.add %c, %b1 : tensor<4xi32>\n%n = ve.shr_s %n0, %sh : tensor<4xi32>\n"
        "%nb = ve.broadcast %n along 1 : tensor<4xi32> -> tensor<4x8xi32>\n"
        "%g = ve.iota along 1 : tensor<4x8xi32>\n%e = ve.iota along 0 : tensor<4x8xi32>\n"
        "%t = ve.tag gt %nb, %g : tensor<4x8xi32> -> tensor<4x8xi4>\n"
        "%ids = ve.filter %e, %t keep [1] along 1 pad -1 : tensor<4x8xi32>, tensor<4x8xi4> -> tensor<4x8xi32>\n"
        "%flat = ve.broadcast %ids along 0 : tensor<4x8xi32> -> tensor<1x4x8xi32>\n"
        "func.return %n, %ids : tensor<4xi32>, tensor<4x8xi32>"
    )
    n, ids = run(body, "%c: tensor<4xi32>", "tensor<4xi32>, tensor<4x8xi32>", counts)
    assert n.tolist() == [2, 0, 3, 1]
    assert ids[0].tolist() == [0, 0, -1, -1, -1, -1, -1, -1]
    assert ids[2].tolist() == [2, 2, 2, -1, -1, -1, -1, -1]
