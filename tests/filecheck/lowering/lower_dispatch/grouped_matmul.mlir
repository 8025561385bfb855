// RUN: tcpc-opt %s -p lower-dispatch | filecheck %s
// RUN: tcpc-opt %s -p lower-dispatch --print-op-generic | tcpc-opt | filecheck %s

// grouped_matmul: a per-block weight gather by expert_ids (-1: nothing read), a blockwise
// contraction into f32 guarded by expert_ids (unused blocks skipped, left zero), the per-expert
// bias gathered the same way and viewed as [G, 1, F], padding rows forced to +0.0 by a row mask
// (built once per plan: the row tokens, a DMA scatter of the token numbers plus one by
// scatter_idx, minus one, tagged >= 0), and one rounding to
// bf16 at the end. T = 6, K = 2, E = 4, B = 4: G = 6.

func.func @up(%x_blocked: tensor<6x4x16xbf16>, %scatter_idx: tensor<6x2xi32>, %expert_ids: tensor<6xi32>,
              %w_up: tensor<4x16x32xbf16>, %b_up: tensor<4x32xbf16>) -> tensor<6x4x32xbf16> {
  %route = moe.route %scatter_idx, %expert_ids : tensor<6x2xi32>, tensor<6xi32> -> !moe.route<T = 6, K = 2, E = 4, B = 4, G = 6>
  %up = moe.grouped_matmul %x_blocked, %w_up, %route bias %b_up : tensor<6x4x16xbf16>, tensor<4x16x32xbf16>, !moe.route<T = 6, K = 2, E = 4, B = 4, G = 6>, tensor<4x32xbf16> -> tensor<6x4x32xbf16>
  func.return %up : tensor<6x4x32xbf16>
}

// CHECK-LABEL: func.func @up
// CHECK-NOT:   moe.
// The row mask, right where the plan was.
// CHECK:       %token_numbers = ve.iota along 0 : tensor<6x1xi32>
// CHECK-NEXT:  %ones = ve.const 1 : tensor<6x1xi32>
// CHECK-NEXT:  %token_marks = ve.add %token_numbers, %ones : tensor<6x1xi32>
// CHECK-NEXT:  %row_marks = tcp.dma_scatter %token_marks[%scatter_idx] : tensor<6x1xi32>, tensor<6x2xi32> -> tensor<24x1xi32>
// CHECK-NEXT:  %block_marks = tcp.view %row_marks : tensor<24x1xi32> -> tensor<6x4xi32>
// CHECK-NEXT:  %ones_1 = ve.const 1 : tensor<6x4xi32>
// CHECK-NEXT:  %block_tokens = ve.sub %block_marks, %ones_1 : tensor<6x4xi32>
// CHECK-NEXT:  %zeros = ve.const 0 : tensor<6x4xi32>
// CHECK-NEXT:  %row_valid = ve.tag ge %block_tokens, %zeros : tensor<6x4xi32> -> tensor<6x4xi4>
// CHECK-NEXT:  %rows_valid = ve.broadcast %row_valid along 2 : tensor<6x4xi4> -> tensor<6x4x32xi4>
// CHECK-NEXT:  %w_gathered = tcp.dma_gather %w_up[%expert_ids] : tensor<4x16x32xbf16>, tensor<6xi32> -> tensor<6x16x32xbf16>
// CHECK-NEXT:  %bias_gathered = tcp.dma_gather %b_up[%expert_ids] : tensor<4x32xbf16>, tensor<6xi32> -> tensor<6x32xbf16>
// CHECK-NEXT:  %bias_blocked = tcp.view %bias_gathered : tensor<6x32xbf16> -> tensor<6x1x32xbf16>
// CHECK-NEXT:  %y_acc = tcp.contract "gbd,gdf->gbf" %x_blocked, %w_gathered bias %bias_blocked guard %expert_ids : tensor<6x4x16xbf16>, tensor<6x16x32xbf16> bias tensor<6x1x32xbf16> guard tensor<6xi32> -> tensor<6x4x32xf32>
// CHECK-NEXT:  %[[Z:.*]] = ve.const 0.0 : tensor<6x4x32xf32>
// CHECK-NEXT:  %y_masked = ve.select %rows_valid in [1], %y_acc, %[[Z]] : tensor<6x4x32xi4>, tensor<6x4x32xf32>
// CHECK-NEXT:  %up = ve.narrow %y_masked : tensor<6x4x32xf32> -> tensor<6x4x32xbf16>
// CHECK-NEXT:  func.return %up : tensor<6x4x32xbf16>

// Without a bias, with an f32 result: no bias gather and no narrowing; the mask stays (the
// input's padding rows need not be zero, and 0 * inf is NaN).

func.func @down(%h: tensor<6x4x32xf32>, %scatter_idx: tensor<6x2xi32>, %expert_ids: tensor<6xi32>,
                %w_down: tensor<4x32x16xbf16>) -> tensor<6x4x16xf32> {
  %route = moe.route %scatter_idx, %expert_ids : tensor<6x2xi32>, tensor<6xi32> -> !moe.route<T = 6, K = 2, E = 4, B = 4, G = 6>
  %0 = moe.grouped_matmul %h, %w_down, %route : tensor<6x4x32xf32>, tensor<4x32x16xbf16>, !moe.route<T = 6, K = 2, E = 4, B = 4, G = 6> -> tensor<6x4x16xf32>
  func.return %0 : tensor<6x4x16xf32>
}

// CHECK-LABEL: func.func @down
// CHECK-NOT:   moe.
// CHECK:       %row_valid = ve.tag ge
// CHECK-NEXT:  %rows_valid = ve.broadcast %row_valid along 2 : tensor<6x4xi4> -> tensor<6x4x16xi4>
// CHECK-NEXT:  %w_gathered = tcp.dma_gather %w_down[%expert_ids] : tensor<4x32x16xbf16>, tensor<6xi32> -> tensor<6x32x16xbf16>
// CHECK-NEXT:  %y_acc = tcp.contract "gbd,gdf->gbf" %h, %w_gathered guard %expert_ids : tensor<6x4x32xf32>, tensor<6x32x16xbf16> guard tensor<6xi32> -> tensor<6x4x16xf32>
// CHECK-NEXT:  %[[Z:.*]] = ve.const 0.0 : tensor<6x4x16xf32>
// CHECK-NEXT:  %y_blocked = ve.select %rows_valid in [1], %y_acc, %[[Z]] : tensor<6x4x16xi4>, tensor<6x4x16xf32>
// CHECK-NEXT:  func.return %y_blocked : tensor<6x4x16xf32>
