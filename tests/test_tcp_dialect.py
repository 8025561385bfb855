"""The tcp dialect, the tile ops and moe.route / moe.dispatch: numpy semantics and costs (their
assembly round trips and verifier messages are tests/filecheck/dialects/)."""

import ml_dtypes
import numpy as np
import pytest
from xdsl.parser import Parser
from xdsl.utils.exceptions import InterpretationError

from runtime_sim.semantics import tcp_semantics
from runtime_sim.semantics.executor import run_function
from runtime_sim.semantics.moe_semantics import RoutePlan, dispatch
from runtime_sim.semantics.numerics import contract
from support import bits
from tcpc.pipelines import make_context

IR = """
func.func @f(%x: tensor<4x8xbf16>, %si: tensor<4x2xi32>, %ei: tensor<5xi32>, %w: tensor<3x8x6xbf16>,
             %b: tensor<5x1x6xf32>) -> (tensor<5x2x6xf32>, tensor<4x2x8xbf16>) {
  %r = moe.route %si, %ei : tensor<4x2xi32>, tensor<5xi32> -> !moe.route<T = 4, K = 2, E = 3, B = 2, G = 5>
  %xb = moe.dispatch %x, %r : tensor<4x8xbf16>, !moe.route<T = 4, K = 2, E = 3, B = 2, G = 5> -> tensor<5x2x8xbf16>
  %wg = tcp.dma_gather %w[%ei] : tensor<3x8x6xbf16>, tensor<5xi32> -> tensor<5x8x6xbf16>
  %y = tcp.contract "gbd,gdf->gbf" %xb, %wg bias %b guard %ei : tensor<5x2x8xbf16>, tensor<5x8x6xbf16> bias tensor<5x1x6xf32> guard tensor<5xi32> -> tensor<5x2x6xf32>
  %rows = tcp.dma_scatter %x[%si] : tensor<4x8xbf16>, tensor<4x2xi32> -> tensor<10x8xbf16>
  %blocks = tcp.view %rows : tensor<10x8xbf16> -> tensor<5x2x8xbf16>
  %flat = tcp.view %blocks : tensor<5x2x8xbf16> -> tensor<10x8xbf16>
  %back = tcp.dma_gather %flat[%si] : tensor<10x8xbf16>, tensor<4x2xi32> -> tensor<4x2x8xbf16>
  func.return %y, %back : tensor<5x2x6xf32>, tensor<4x2x8xbf16>
}
"""


def parse(text: str):
    module = Parser(make_context(), text).parse_module()
    module.verify()
    return module


def test_semantics_blockwise_pipeline() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16)
    # experts chosen: token t -> (t % 3, (t + 1) % 3); E = 3, B = 2
    si = np.array([[0, 4], [6, 2], [3, 8], [1, 5]], dtype=np.int32)
    ei = np.array([0, 0, 1, 1, 2, -1], dtype=np.int32)[:5]
    w = rng.standard_normal((3, 8, 6)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((5, 1, 6)).astype(np.float32)
    y, back = run_function(parse(IR), "f", [x, si, ei, w, b])
    xb = dispatch(x, RoutePlan(si, ei, 2))
    for g, e in enumerate(ei):
        want = xb[g].astype(np.float32) @ w[e].astype(np.float32) + b[g]
        np.testing.assert_allclose(y[g], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(back.astype(np.float32), np.repeat(x[:, None, :], 2, axis=1).astype(np.float32))


def test_guard_skips_block_and_minus_one_skips_rows() -> None:
    x = np.ones((4, 8), dtype=ml_dtypes.bfloat16)
    si = np.array([[0, -1], [1, -1], [2, -1], [3, -1]], dtype=np.int32)
    ei = np.array([0, 0, -1, -1, -1], dtype=np.int32)
    w = np.ones((3, 8, 6), dtype=ml_dtypes.bfloat16)
    b = np.ones((5, 1, 6), dtype=np.float32)
    y, back = run_function(parse(IR), "f", [x, si, ei, w, b])
    assert (y[2:] == 0).all() and (y[:2] == 9).all()
    assert (back[:, 1].astype(np.float32) == 0).all()


def test_out_of_range_row_is_an_execution_error() -> None:
    x = np.ones((4, 8), dtype=ml_dtypes.bfloat16)
    si = np.array([[0, 10], [1, 2], [3, 4], [5, 6]], dtype=np.int32)
    ei = np.zeros(5, dtype=np.int32)
    with pytest.raises(InterpretationError, match="outside"):
        run_function(parse(IR), "f", [x, si, ei, np.ones((3, 8, 6), ml_dtypes.bfloat16), np.ones((5, 1, 6), np.float32)])


ACC_IR = """
func.func @k(%a: tensor<2x2x8xbf16>, %w: tensor<2x8x3xbf16>, %acc: tensor<2x2x3xf32>, %ids: tensor<2xi32>) -> tensor<2x2x3xf32> {
  %lo = tcp.contract "gbd,gdf->gbf" %a, %w acc %acc guard %ids : tensor<2x2x8xbf16>, tensor<2x8x3xbf16> acc tensor<2x2x3xf32> guard tensor<2xi32> -> tensor<2x2x3xf32>
  func.return %lo : tensor<2x2x3xf32>
}
"""


def test_contract_accumulates_onto_acc_and_a_skipped_block_keeps_it() -> None:
    module = parse(ACC_IR)
    a = np.ones((2, 2, 8), ml_dtypes.bfloat16)
    w = np.ones((2, 8, 3), ml_dtypes.bfloat16)
    acc = np.full((2, 2, 3), 0.5, np.float32)
    (y,) = run_function(module, "k", [a, w, acc, np.array([1, -1], np.int32)])
    assert (y[0] == 8.5).all() and (y[1] == 0.5).all()


GUARDED_IR = """
func.func @g(%a: tensor<4x3x600xbf16>, %w: tensor<600x5xbf16>, %ws: tensor<2x600x5xbf16>, %acc: tensor<4x3x5xf32>,
             %ids: tensor<4xi32>) -> (tensor<4x3x5xf32>, tensor<4x3x5xf32>) {
  %s = tcp.contract "gbd,df->gbf" %a, %w acc %acc guard %ids : tensor<4x3x600xbf16>, tensor<600x5xbf16> acc tensor<4x3x5xf32> guard tensor<4xi32> -> tensor<4x3x5xf32>
  %wg = tcp.dma_gather %ws[%ids] : tensor<2x600x5xbf16>, tensor<4xi32> -> tensor<4x600x5xbf16>
  %b = tcp.contract "gbd,gdf->gbf" %a, %wg guard %ids : tensor<4x3x600xbf16>, tensor<4x600x5xbf16> guard tensor<4xi32> -> tensor<4x3x5xf32>
  func.return %s, %b : tensor<4x3x5xf32>, tensor<4x3x5xf32>
}
"""


def test_a_guarded_contract_computes_only_the_blocks_that_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks 1 and 3 skipped: the products are taken of blocks 0 and 2 alone (by one weight, and
    each by its own gathered weight), with the bits of the product of every block, masked."""
    computed: list[int] = []

    def counted(spec: str, lhs, rhs, acc=None):  # type: ignore[no-untyped-def]
        computed.append(lhs.shape[0])
        return contract(spec, lhs, rhs, acc)

    monkeypatch.setattr(tcp_semantics, "contract", counted)
    rng = np.random.default_rng(2)
    a = rng.standard_normal((4, 3, 600)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((600, 5)).astype(ml_dtypes.bfloat16)
    ws = rng.standard_normal((2, 600, 5)).astype(ml_dtypes.bfloat16)
    acc = rng.standard_normal((4, 3, 5)).astype(np.float32)
    ids = np.array([1, -1, 0, -1], np.int32)
    shared, own = run_function(parse(GUARDED_IR), "g", [a, w, ws, acc, ids])
    assert computed == [2, 2]
    runs = (ids >= 0)[:, None, None]
    assert np.array_equal(bits(shared), bits(np.where(runs, contract("gbd,df->gbf", a, w, acc), acc)))
    assert np.array_equal(bits(own), bits(np.where(runs, contract("gbd,gdf->gbf", a, ws[np.maximum(ids, 0)]), 0)))


WINDOW_IR = """
func.func @w(%w: tensor<3x4x10xbf16>, %ids: tensor<1xi32>) -> tensor<1x4x3xbf16> {
  %t = tile.load_expert %w[%ids] at array<i64: 0, 6> : tensor<3x4x10xbf16>, tensor<1xi32> -> tensor<1x4x3xbf16>
  func.return %t : tensor<1x4x3xbf16>
}
"""


def test_load_expert_window_takes_the_columns_and_id_minus_one_gives_zeros() -> None:
    module = parse(WINDOW_IR)
    w = np.arange(3 * 4 * 10, dtype=np.float32).reshape(3, 4, 10).astype(ml_dtypes.bfloat16)
    (t,) = run_function(module, "w", [w, np.array([2], np.int32)])
    assert np.array_equal(t.astype(np.float32), w[2:3, :, 6:9].astype(np.float32))
    (t,) = run_function(module, "w", [w, np.array([-1], np.int32)])
    assert not t.astype(np.float32).any()


def test_the_accumulator_is_fetched_and_a_window_moves_in_pieces() -> None:
    """Costs: an accumulating contraction reads its f32 accumulator like an operand; a window of
    columns moves one contiguous piece per row, a window of rows one piece."""
    from target.machine import load_machine
    from runtime_sim.perf.tcp_cost import cost_contract
    from dialects.tensor_types import window_pieces

    machine = load_machine()
    no_acc = ACC_IR.replace(" acc %acc", "").replace(" acc tensor<2x2x3xf32>", "")
    a, w = np.zeros((2, 2, 8), ml_dtypes.bfloat16), np.zeros((2, 8, 3), ml_dtypes.bfloat16)
    acc, ids, out = np.zeros((2, 2, 3), np.float32), np.array([0, 1], np.int32), np.zeros((2, 2, 3), np.float32)
    (op,) = [o for o in parse(ACC_IR).walk() if o.name == "tcp.contract"]
    (plain,) = [o for o in parse(no_acc).walk() if o.name == "tcp.contract"]
    with_acc = cost_contract(op, (a, w, ids, acc), (out,), machine)
    without = cost_contract(plain, (a, w, ids), (out,), machine)
    assert with_acc.bytes_moved - without.bytes_moved == acc.nbytes
    assert window_pieces((4096, 14336), (4096, 512)) == 4096
    assert window_pieces((14336, 4096), (512, 4096)) == 1
    assert window_pieces((4096, 14336), (4096, 14336)) == 1


SCALED_ACC_IR = """
func.func @s(%a: tensor<2x2x8xf8E4M3FN>, %w: tensor<2x8x4xf8E4M3FN>, %as: tensor<2x2x2xf32>, %ws: tensor<2x2x2xf32>, %acc: tensor<2x2x4xf32>, %ids: tensor<2xi32>) -> tensor<2x2x4xf32> {
  %y = tcp.scaled_contract %a, %w scales %as, %ws acc %acc guard %ids : tensor<2x2x8xf8E4M3FN>, tensor<2x8x4xf8E4M3FN>, tensor<2x2x2xf32>, tensor<2x2x2xf32> acc tensor<2x2x4xf32> guard tensor<2xi32> -> tensor<2x2x4xf32>
  func.return %y : tensor<2x2x4xf32>
}
"""


GATHER_IR = """
func.func @r(%x: tensor<5x3xbf16>, %rows: tensor<1x4xi32>, %wait: tensor<1xf32>) -> tensor<1x4x3xbf16> {
  %t = tile.gather %x[%rows] after %wait : tensor<5x3xbf16>, tensor<1x4xi32> after tensor<1xf32> -> tensor<1x4x3xbf16>
  func.return %t : tensor<1x4x3xbf16>
}
"""


def test_scaled_contract_split_along_d_continues_the_sum_bit_for_bit() -> None:
    """A block-scaled contraction cut at a K-block edge, the second half starting from the
    first half's sum (`acc`), gives the whole contraction's bits; a skipped block keeps acc."""
    from runtime_sim.semantics.quantization import scaled_contract

    module = parse(SCALED_ACC_IR)
    rng = np.random.default_rng(0)
    a = rng.normal(size=(2, 2, 8)).astype(ml_dtypes.float8_e4m3fn)
    w = rng.normal(size=(2, 8, 4)).astype(ml_dtypes.float8_e4m3fn)
    a_s = rng.uniform(0.01, 1, (2, 2, 2)).astype(np.float32)
    w_s = rng.uniform(0.01, 1, (2, 2, 2)).astype(np.float32)
    whole = scaled_contract(a, a_s, w, w_s)
    first = scaled_contract(a[:, :, :4], a_s[:, :, :1], w[:, :4], w_s[:, :1])
    second = scaled_contract(a[:, :, 4:], a_s[:, :, 1:], w[:, 4:], w_s[:, 1:], acc=first)
    assert np.array_equal(second.view(np.uint32), whole.view(np.uint32))
    acc = np.full((2, 2, 4), 0.5, np.float32)
    (y,) = run_function(module, "s", [a, w, a_s, w_s, acc, np.array([0, -1], np.int32)])
    assert np.array_equal(y[0], scaled_contract(a[:1], a_s[:1], w[:1], w_s[:1], acc=acc[:1])[0]) and (y[1] == 0.5).all()


SLICE_WINDOW_IR = """
func.func @v(%s: tensor<3x4x10xf32>, %i: index) -> tensor<1x2x3xf32> {
  %t = tile.slice %s[%i] at array<i64: 1, 6> : tensor<3x4x10xf32> -> tensor<1x2x3xf32>
  func.return %t : tensor<1x2x3xf32>
}
"""


def test_slice_window_addresses_part_of_a_row() -> None:
    module = parse(SLICE_WINDOW_IR)
    s = np.arange(3 * 4 * 10, dtype=np.float32).reshape(3, 4, 10)
    (t,) = run_function(module, "v", [s, 2])
    assert np.array_equal(t, s[2:3, 1:3, 6:9])


def test_row_gather_takes_the_rows_and_row_minus_one_gives_zeros() -> None:
    module = parse(GATHER_IR)
    x = np.arange(15, dtype=np.float32).reshape(5, 3).astype(ml_dtypes.bfloat16)
    (t,) = run_function(module, "r", [x, np.array([[4, -1, 0, 4]], np.int32), np.zeros(1, np.float32)])
    assert np.array_equal(t.astype(np.float32), np.stack([x[4], np.zeros(3), x[0], x[4]]).astype(np.float32)[None])
