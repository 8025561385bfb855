// RUN: tcpc-opt %s -p lower-routing | filecheck %s

// A capacity of 3 pairs per expert (C < T = 6): counts are clipped before the block count,
// and a pair is kept iff its position within its expert (token-major) is below C.
// R = ceil(min(T, C) / B) = 2 blocks at most per expert.

func.func @capped(%x: tensor<6x16xf32>, %idx: tensor<6x2xi32>) -> tensor<8x2x16xf32> {
  %xb, %route = moe.scatter %x, %idx : tensor<6x16xf32>, tensor<6x2xi32> -> tensor<8x2x16xf32>, !moe.route<T = 6, K = 2, E = 4, B = 2, G = 8, C = 3>
  func.return %xb : tensor<8x2x16xf32>
}

// CHECK-LABEL: func.func @capped
// CHECK-NOT:   moe.scatter
// CHECK:       %counts = ve.reduce_sum %expert_mask along 0 : tensor<12x4xi32> -> tensor<4xi32>
// CHECK-NEXT:  %[[C:.*]] = ve.const 3 : tensor<4xi32>
// CHECK-NEXT:  %kept_counts = ve.min %counts, %[[C]] : tensor<4xi32>
// CHECK-NEXT:  %block_range = ve.iota along 1 : tensor<4x2xi32>
// CHECK:       %counts_tile = ve.broadcast %kept_counts along 1 : tensor<4xi32> -> tensor<4x2xi32>
// CHECK:       %num_blocks = ve.reduce_sum %opened along 1 : tensor<4x2xi32> -> tensor<4xi32>
// CHECK:       ve.scan add %num_blocks, %expert_position along 0 read [1, 2] write [0, 1] : tensor<4xi32>, tensor<4xi4>
// CHECK:       ve.scan add %expert_mask, %pair_position along 0 read [1, 2] write [0, 1] : tensor<12x4xi32>, tensor<12x4xi4>
// CHECK:       %pair_row = ve.add %pair_first_row, %local_offset : tensor<12xi32>
// CHECK-NEXT:  %[[CP:.*]] = ve.const 3 : tensor<12xi32>
// CHECK-NEXT:  %kept = ve.tag lt %local_offset, %[[CP]] : tensor<12xi32> -> tensor<12xi4>
// CHECK:       %pair_scatter_idx = ve.select %kept in [1], %pair_row, %{{.*}} : tensor<12xi4>, tensor<12xi32>
// CHECK:       %expert_ids = ve.filter %flat_grid, %is_expert keep [1] along 0 pad -1 : tensor<8xi32>, tensor<8xi4> -> tensor<8xi32>
// CHECK:       %route = moe.route %scatter_idx, %expert_ids : tensor<6x2xi32>, tensor<8xi32> -> !moe.route<T = 6, K = 2, E = 4, B = 2, G = 8, C = 3>
// CHECK-NEXT:  %xb = moe.dispatch %x, %route
