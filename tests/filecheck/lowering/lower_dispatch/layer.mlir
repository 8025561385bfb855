// RUN: tcpc-opt %s -p lower-dispatch | filecheck %s

// A whole expert layer on one plan, as lower-routing leaves it (the plan here comes from function
// arguments): dispatch, SwiGLU experts (gate with a bias, up without), down, weighted combine.
// One row mask serves every grouped_matmul of the plan (one broadcast per width); each
// grouped_matmul gathers its own weights; the moe.route is gone.
// T = 8, K = 2, E = 4, B = 2: G = 10.

func.func @layer(%x: tensor<8x16xbf16>, %scatter_idx: tensor<8x2xi32>, %expert_ids: tensor<10xi32>,
                 %w_gate: tensor<4x16x32xbf16>, %b_gate: tensor<4x32xf32>, %w_up: tensor<4x16x32xbf16>,
                 %w_down: tensor<4x32x16xbf16>, %weights: tensor<8x2xf32>) -> tensor<8x16xbf16> {
  %route = moe.route %scatter_idx, %expert_ids : tensor<8x2xi32>, tensor<10xi32> -> !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>
  %xb = moe.dispatch %x, %route : tensor<8x16xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10> -> tensor<10x2x16xbf16>
  %gate = moe.grouped_matmul %xb, %w_gate, %route bias %b_gate : tensor<10x2x16xbf16>, tensor<4x16x32xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>, tensor<4x32xf32> -> tensor<10x2x32xbf16>
  %up = moe.grouped_matmul %xb, %w_up, %route : tensor<10x2x16xbf16>, tensor<4x16x32xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10> -> tensor<10x2x32xbf16>
  %h = tmath.mul %gate, %up : (tensor<10x2x32xbf16>, tensor<10x2x32xbf16>) -> tensor<10x2x32xbf16>
  %yb = moe.grouped_matmul %h, %w_down, %route : tensor<10x2x32xbf16>, tensor<4x32x16xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10> -> tensor<10x2x16xbf16>
  %out = moe.combine %yb, %route weights %weights : tensor<10x2x16xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>, tensor<8x2xf32> -> tensor<8x16xbf16>
  func.return %out : tensor<8x16xbf16>
}

// CHECK-LABEL: func.func @layer
// CHECK-NOT:   moe.
// CHECK:       %row_marks = tcp.dma_scatter %token_marks[%scatter_idx] : tensor<8x1xi32>, tensor<8x2xi32> -> tensor<20x1xi32>
// CHECK:       %block_tokens = ve.sub %block_marks, %{{.*}} : tensor<10x2xi32>
// CHECK:       %row_valid = ve.tag ge %block_tokens, %{{.*}} : tensor<10x2xi32> -> tensor<10x2xi4>
// CHECK-NEXT:  %rows_valid = ve.broadcast %row_valid along 2 : tensor<10x2xi4> -> tensor<10x2x32xi4>
// CHECK-NEXT:  %rows_valid_1 = ve.broadcast %row_valid along 2 : tensor<10x2xi4> -> tensor<10x2x16xi4>
// CHECK-NOT:   %row_valid
// CHECK-NEXT:  %xb = tcp.dma_gather %x[%block_tokens] : tensor<8x16xbf16>, tensor<10x2xi32> -> tensor<10x2x16xbf16> {tcpc.phase = "dispatch"}
// CHECK-NEXT:  %w_gathered = tcp.dma_gather %w_gate[%expert_ids] : tensor<4x16x32xbf16>, tensor<10xi32> -> tensor<10x16x32xbf16>
// CHECK-NEXT:  %bias_gathered = tcp.dma_gather %b_gate[%expert_ids] : tensor<4x32xf32>, tensor<10xi32> -> tensor<10x32xf32>
// CHECK-NEXT:  %bias_blocked = tcp.view %bias_gathered : tensor<10x32xf32> -> tensor<10x1x32xf32>
// CHECK-NEXT:  %y_acc = tcp.contract "gbd,gdf->gbf" %xb, %w_gathered bias %bias_blocked guard %expert_ids : {{.*}} -> tensor<10x2x32xf32>
// CHECK:       %y_masked = ve.select %rows_valid in [1], %y_acc, %{{.*}}
// CHECK-NEXT:  %gate = ve.narrow %y_masked : tensor<10x2x32xf32> -> tensor<10x2x32xbf16>
// CHECK-NEXT:  %w_gathered_1 = tcp.dma_gather %w_up[%expert_ids]
// CHECK-NEXT:  %y_acc_1 = tcp.contract "gbd,gdf->gbf" %xb, %w_gathered_1 guard %expert_ids : {{.*}} -> tensor<10x2x32xf32>
// CHECK:       %y_masked_1 = ve.select %rows_valid in [1], %y_acc_1, %{{.*}}
// CHECK-NEXT:  %up = ve.narrow %y_masked_1
// CHECK-NEXT:  %h = tmath.mul %gate, %up
// CHECK-NEXT:  %w_gathered_2 = tcp.dma_gather %w_down[%expert_ids] : tensor<4x32x16xbf16>, tensor<10xi32> -> tensor<10x32x16xbf16>
// CHECK-NEXT:  %y_acc_2 = tcp.contract "gbd,gdf->gbf" %h, %w_gathered_2 guard %expert_ids : {{.*}} -> tensor<10x2x16xf32>
// CHECK:       %y_masked_2 = ve.select %rows_valid_1 in [1], %y_acc_2, %{{.*}}
// CHECK-NEXT:  %yb = ve.narrow %y_masked_2
// CHECK-NEXT:  %y_rows = tcp.view %yb : tensor<10x2x16xbf16> -> tensor<20x16xbf16>
// CHECK-NEXT:  %y_restored = tcp.dma_gather %y_rows[%scatter_idx] : tensor<20x16xbf16>, tensor<8x2xi32> -> tensor<8x2x16xbf16>
// CHECK:       %y_weighted = ve.mul %weights_spread, %y_restored_f32 : tensor<8x2x16xf32>
// CHECK-NEXT:  %y_sum = ve.reduce_sum %y_weighted along 1 : tensor<8x2x16xf32> -> tensor<8x16xf32>
// CHECK:       %out = ve.narrow %moe_out_f32 : tensor<8x16xf32> -> tensor<8x16xbf16>
// CHECK-NEXT:  func.return %out : tensor<8x16xbf16>
