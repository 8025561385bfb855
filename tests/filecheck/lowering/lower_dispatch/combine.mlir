// RUN: tcpc-opt %s -p lower-dispatch | filecheck %s
// RUN: tcpc-opt %s -p lower-dispatch --print-op-generic | tcpc-opt | filecheck %s

// combine: the blocks viewed as G*B rows, gathered back to [T, K, D] by scatter_idx (a dropped
// pair, -1, reads nothing and is zero), widened to f32, weighted (a dropped pair's weight is
// forced to +0.0 first, so a NaN or inf weight never meets its zero row), summed along K left
// to right, + 0.0 (the reference's accumulator starts at +0.0), rounded once to bf16.
// T = 6, K = 2, E = 4, B = 4, capacity 2: G = 4.

func.func @combine(%y_blocked: tensor<4x4x16xbf16>, %scatter_idx: tensor<6x2xi32>, %expert_ids: tensor<4xi32>,
                   %weights: tensor<6x2xbf16>) -> tensor<6x16xbf16> {
  %route = moe.route %scatter_idx, %expert_ids : tensor<6x2xi32>, tensor<4xi32> -> !moe.route<T = 6, K = 2, E = 4, B = 4, G = 4, C = 2>
  %moe_out = moe.combine %y_blocked, %route weights %weights : tensor<4x4x16xbf16>, !moe.route<T = 6, K = 2, E = 4, B = 4, G = 4, C = 2>, tensor<6x2xbf16> -> tensor<6x16xbf16>
  func.return %moe_out : tensor<6x16xbf16>
}

// CHECK-LABEL: func.func @combine
// CHECK-NOT:   moe.
// CHECK:       %y_rows = tcp.view %y_blocked : tensor<4x4x16xbf16> -> tensor<16x16xbf16>
// CHECK-NEXT:  %y_restored = tcp.dma_gather %y_rows[%scatter_idx] : tensor<16x16xbf16>, tensor<6x2xi32> -> tensor<6x2x16xbf16>
// CHECK-NEXT:  %y_restored_f32 = ve.widen %y_restored : tensor<6x2x16xbf16> -> tensor<6x2x16xf32>
// CHECK-NEXT:  %weights_f32 = ve.widen %weights : tensor<6x2xbf16> -> tensor<6x2xf32>
// CHECK-NEXT:  %[[Z:.*]] = ve.const 0 : tensor<6x2xi32>
// CHECK-NEXT:  %pair_kept = ve.tag ge %scatter_idx, %[[Z]] : tensor<6x2xi32> -> tensor<6x2xi4>
// CHECK-NEXT:  %[[ZF:.*]] = ve.const 0.0 : tensor<6x2xf32>
// CHECK-NEXT:  %weights_kept = ve.select %pair_kept in [1], %weights_f32, %[[ZF]] : tensor<6x2xi4>, tensor<6x2xf32>
// CHECK-NEXT:  %weights_spread = ve.broadcast %weights_kept along 2 : tensor<6x2xf32> -> tensor<6x2x16xf32>
// CHECK-NEXT:  %y_weighted = ve.mul %weights_spread, %y_restored_f32 : tensor<6x2x16xf32>
// CHECK-NEXT:  %y_sum = ve.reduce_sum %y_weighted along 1 : tensor<6x2x16xf32> -> tensor<6x16xf32>
// CHECK-NEXT:  %[[ZO:.*]] = ve.const 0.0 : tensor<6x16xf32>
// CHECK-NEXT:  %moe_out_f32 = ve.add %y_sum, %[[ZO]] : tensor<6x16xf32>
// CHECK-NEXT:  %moe_out = ve.narrow %moe_out_f32 : tensor<6x16xf32> -> tensor<6x16xbf16>
// CHECK-NEXT:  func.return %moe_out : tensor<6x16xbf16>

// Without weights (weight-on-input models) and in f32: a plain sum, no widening, no narrowing.

func.func @plain(%y_blocked: tensor<4x4x16xf32>, %scatter_idx: tensor<6x2xi32>, %expert_ids: tensor<4xi32>) -> tensor<6x16xf32> {
  %route = moe.route %scatter_idx, %expert_ids : tensor<6x2xi32>, tensor<4xi32> -> !moe.route<T = 6, K = 2, E = 4, B = 4, G = 4, C = 2>
  %routed = moe.combine %y_blocked, %route : tensor<4x4x16xf32>, !moe.route<T = 6, K = 2, E = 4, B = 4, G = 4, C = 2> -> tensor<6x16xf32>
  func.return %routed : tensor<6x16xf32>
}

// CHECK-LABEL: func.func @plain
// CHECK-NOT:   moe.
// CHECK:       %y_rows = tcp.view %y_blocked : tensor<4x4x16xf32> -> tensor<16x16xf32>
// CHECK-NEXT:  %y_restored = tcp.dma_gather %y_rows[%scatter_idx] : tensor<16x16xf32>, tensor<6x2xi32> -> tensor<6x2x16xf32>
// CHECK-NEXT:  %y_sum = ve.reduce_sum %y_restored along 1 : tensor<6x2x16xf32> -> tensor<6x16xf32>
// CHECK-NEXT:  %[[ZO:.*]] = ve.const 0.0 : tensor<6x16xf32>
// CHECK-NEXT:  %routed = ve.add %y_sum, %[[ZO]] : tensor<6x16xf32>
// CHECK-NEXT:  func.return %routed : tensor<6x16xf32>

// Of bf16 rows widened to f32 (expert parallelism's allgather sums f32 partial rows): the
// combine gathers the bf16 rows and widens what it gathered, as above; the widening of the
// whole [G, B, D] tensor is gone (at prefill it was hundreds of MB of f32 rows).

func.func @widened(%y_blocked: tensor<4x4x16xbf16>, %scatter_idx: tensor<6x2xi32>, %expert_ids: tensor<4xi32>) -> tensor<6x16xf32> {
  %route = moe.route %scatter_idx, %expert_ids : tensor<6x2xi32>, tensor<4xi32> -> !moe.route<T = 6, K = 2, E = 4, B = 4, G = 4, C = 2>
  %rows_f32 = tmath.cast %y_blocked : tensor<4x4x16xbf16> -> tensor<4x4x16xf32>
  %partial = moe.combine %rows_f32, %route : tensor<4x4x16xf32>, !moe.route<T = 6, K = 2, E = 4, B = 4, G = 4, C = 2> -> tensor<6x16xf32>
  func.return %partial : tensor<6x16xf32>
}

// CHECK-LABEL: func.func @widened
// CHECK-NOT:   tmath.cast
// CHECK:       %y_rows = tcp.view %y_blocked : tensor<4x4x16xbf16> -> tensor<16x16xbf16>
// CHECK-NEXT:  %y_restored = tcp.dma_gather %y_rows[%scatter_idx] : tensor<16x16xbf16>, tensor<6x2xi32> -> tensor<6x2x16xbf16>
// CHECK-NEXT:  %y_restored_f32 = ve.widen %y_restored : tensor<6x2x16xbf16> -> tensor<6x2x16xf32>
// CHECK-NEXT:  %y_sum = ve.reduce_sum %y_restored_f32 along 1 : tensor<6x2x16xf32> -> tensor<6x16xf32>
// CHECK-NEXT:  %[[ZO:.*]] = ve.const 0.0 : tensor<6x16xf32>
// CHECK-NEXT:  %partial = ve.add %y_sum, %[[ZO]] : tensor<6x16xf32>
// CHECK-NEXT:  func.return %partial : tensor<6x16xf32>
