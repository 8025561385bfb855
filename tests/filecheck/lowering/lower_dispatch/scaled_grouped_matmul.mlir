// RUN: tcpc-opt %s -p lower-dispatch | filecheck %s
// RUN: tcpc-opt %s -p lower-dispatch --print-op-generic | tcpc-opt | filecheck %s

// A block-scaled fp8 grouped matmul: the weights and their block scales are gathered per block
// at their stored width (f8e4m3: one byte a value; the small scales first, right after the
// plan's row masks, so they never queue behind weight gathers), and one tcp.scaled_contract multiplies the
// fp8 pairs into f32 partial sums per K-block and applies the scales to them in the chain's
// vector stage; then the padding mask and one rounding to bf16, as for grouped_matmul.
// T = 4, K = 2, E = 4, B = 2: G = 6. D = 256 in groups of 128, F = 128, weight blocks 128 x 128.

func.func @experts(%xq: tensor<6x2x256xf8E4M3FN>, %xs: tensor<6x2x2xf32>, %w: tensor<4x256x128xf8E4M3FN>,
                   %ws: tensor<4x2x1xf32>, %scatter_idx: tensor<4x2xi32>, %expert_ids: tensor<6xi32>) -> tensor<6x2x128xbf16> {
  %route = moe.route %scatter_idx, %expert_ids : tensor<4x2xi32>, tensor<6xi32> -> !moe.route<T = 4, K = 2, E = 4, B = 2, G = 6>
  %yb = moe.scaled_grouped_matmul %xq, %w, %route scales %xs, %ws : tensor<6x2x256xf8E4M3FN>, tensor<4x256x128xf8E4M3FN>, !moe.route<T = 4, K = 2, E = 4, B = 2, G = 6>, tensor<6x2x2xf32>, tensor<4x2x1xf32> -> tensor<6x2x128xbf16>
  func.return %yb : tensor<6x2x128xbf16>
}

// CHECK-LABEL: func.func @experts
// CHECK-NOT:   moe.
// CHECK:       %row_valid = ve.tag ge %block_tokens
// CHECK-NEXT:  %rows_valid = ve.broadcast %row_valid along 2 : tensor<6x2xi4> -> tensor<6x2x128xi4>
// CHECK-NEXT:  %w_scales_gathered = tcp.dma_gather %ws[%expert_ids] : tensor<4x2x1xf32>, tensor<6xi32> -> tensor<6x2x1xf32>
// CHECK-NEXT:  %w_gathered = tcp.dma_gather %w[%expert_ids] : tensor<4x256x128xf8E4M3FN>, tensor<6xi32> -> tensor<6x256x128xf8E4M3FN>
// CHECK-NEXT:  %y_acc = tcp.scaled_contract %xq, %w_gathered scales %xs, %w_scales_gathered guard %expert_ids : tensor<6x2x256xf8E4M3FN>, tensor<6x256x128xf8E4M3FN>, tensor<6x2x2xf32>, tensor<6x2x1xf32> guard tensor<6xi32> -> tensor<6x2x128xf32>
// CHECK-NEXT:  %[[Z:.*]] = ve.const 0.0 : tensor<6x2x128xf32>
// CHECK-NEXT:  %y_masked = ve.select %rows_valid in [1], %y_acc, %[[Z]] : tensor<6x2x128xi4>, tensor<6x2x128xf32>
// CHECK-NEXT:  %yb = ve.narrow %y_masked : tensor<6x2x128xf32> -> tensor<6x2x128xbf16>
// CHECK-NEXT:  func.return %yb
