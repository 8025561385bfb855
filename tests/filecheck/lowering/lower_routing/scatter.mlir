// RUN: tcpc-opt %s -p lower-routing | filecheck %s

// Five tokens, top-2 of four experts, blocks of two rows (G = 7, R = ceil(5 / 2) = 3 blocks at
// most per expert): the index generation becomes ve ops in the order of the book's MoE chapter,
// and the scatter becomes moe.route + moe.dispatch.

func.func @small(%x: tensor<5x8xbf16>, %top_e: tensor<5x2xi32>) -> tensor<7x2x8xbf16> {
  %xb, %route = moe.scatter %x, %top_e : tensor<5x8xbf16>, tensor<5x2xi32> -> tensor<7x2x8xbf16>, !moe.route<T = 5, K = 2, E = 4, B = 2, G = 7>
  func.return %xb : tensor<7x2x8xbf16>
}

// CHECK-LABEL: func.func @small
// CHECK-NOT:   moe.scatter
// One-hot of the pairs p = t*K + k against an expert iota.
// CHECK:       %pair_expert = tcp.view %top_e : tensor<5x2xi32> -> tensor<10xi32>
// CHECK-NEXT:  %chosen_expert = ve.broadcast %pair_expert along 1 : tensor<10xi32> -> tensor<10x4xi32>
// CHECK-NEXT:  %expert_index = ve.iota along 1 : tensor<10x4xi32>
// CHECK-NEXT:  %one_hot = ve.tag eq %chosen_expert, %expert_index : tensor<10x4xi32> -> tensor<10x4xi4>
// CHECK:       %expert_mask = ve.select %one_hot in [1], %{{.*}}, %{{.*}} : tensor<10x4xi4>, tensor<10x4xi32>
// Histogram, and ceil(counts / B) by counting the block starts g * B below each count.
// CHECK-NEXT:  %counts = ve.reduce_sum %expert_mask along 0 : tensor<10x4xi32> -> tensor<4xi32>
// CHECK-NOT:   ve.min
// CHECK-NEXT:  %block_range = ve.iota along 1 : tensor<4x3xi32>
// CHECK-NEXT:  %[[B:.*]] = ve.const 2 : tensor<4x3xi32>
// CHECK-NEXT:  %block_start = ve.mul %block_range, %[[B]] : tensor<4x3xi32>
// CHECK-NEXT:  %counts_tile = ve.broadcast %counts along 1 : tensor<4xi32> -> tensor<4x3xi32>
// CHECK-NEXT:  %opens_block = ve.tag gt %counts_tile, %block_start : tensor<4x3xi32> -> tensor<4x3xi4>
// CHECK:       %opened = ve.select %opens_block in [1]
// CHECK-NEXT:  %num_blocks = ve.reduce_sum %opened along 1 : tensor<4x3xi32> -> tensor<4xi32>
// Global offsets: the branch-logged cumsum over experts, made exclusive.
// CHECK-NEXT:  %expert_position = ve.position_tag along 0 first 0 middle 1 last 2 single 3 : tensor<4xi4>
// CHECK-NEXT:  %blocks_cumsum = ve.scan add %num_blocks, %expert_position along 0 read [1, 2] write [0, 1] : tensor<4xi32>, tensor<4xi4>
// CHECK-NEXT:  %global_offset = ve.sub %blocks_cumsum, %num_blocks : tensor<4xi32>
// Local offsets: the branch-logged cumsum over the flattened pairs axis, gathered at the
// chosen expert by the one-hot (select + reduce over E).
// CHECK-NEXT:  %pair_position = ve.position_tag along 0 first 0 middle 1 last 2 single 3 : tensor<10x4xi4>
// CHECK-NEXT:  %mask_cumsum = ve.scan add %expert_mask, %pair_position along 0 read [1, 2] write [0, 1] : tensor<10x4xi32>, tensor<10x4xi4>
// CHECK-NEXT:  %[[R:.*]] = ve.select %one_hot in [1], %mask_cumsum, %{{.*}} : tensor<10x4xi4>, tensor<10x4xi32>
// CHECK-NEXT:  %token_rank = ve.reduce_sum %[[R]] along 1 : tensor<10x4xi32> -> tensor<10xi32>
// CHECK:       %local_offset = ve.sub %token_rank, %{{.*}} : tensor<10xi32>
// CHECK-NEXT:  %offset_tile = ve.broadcast %global_offset along 0 : tensor<4xi32> -> tensor<10x4xi32>
// CHECK-NEXT:  %[[G:.*]] = ve.select %one_hot in [1], %offset_tile, %{{.*}} : tensor<10x4xi4>, tensor<10x4xi32>
// CHECK-NEXT:  %pair_global_offset = ve.reduce_sum %[[G]] along 1 : tensor<10x4xi32> -> tensor<10xi32>
// scatter_idx = global_offset * B + local_offset; without a capacity, the limit is R * B = 6.
// CHECK:       %pair_first_row = ve.mul %pair_global_offset, %{{.*}} : tensor<10xi32>
// CHECK-NEXT:  %pair_row = ve.add %pair_first_row, %local_offset : tensor<10xi32>
// CHECK-NEXT:  %[[L:.*]] = ve.const 6 : tensor<10xi32>
// CHECK-NEXT:  %kept = ve.tag lt %local_offset, %[[L]] : tensor<10xi32> -> tensor<10xi4>
// CHECK-NEXT:  %[[M:.*]] = ve.const -1 : tensor<10xi32>
// CHECK-NEXT:  %pair_scatter_idx = ve.select %kept in [1], %pair_row, %[[M]] : tensor<10xi4>, tensor<10xi32>
// CHECK-NEXT:  %scatter_idx = tcp.view %pair_scatter_idx : tensor<10xi32> -> tensor<5x2xi32>
// Expert-id expansion: positive differences num_blocks - g, filter-compacted into G.
// CHECK-NEXT:  %num_blocks_tile = ve.broadcast %num_blocks along 1 : tensor<4xi32> -> tensor<4x3xi32>
// CHECK-NEXT:  %diff = ve.sub %num_blocks_tile, %block_range : tensor<4x3xi32>
// CHECK-NEXT:  %has_block = ve.tag gt %diff, %{{.*}} : tensor<4x3xi32> -> tensor<4x3xi4>
// CHECK-NEXT:  %block_expert = ve.iota along 0 : tensor<4x3xi32>
// CHECK:       %grid = ve.select %has_block in [1], %block_expert, %{{.*}} : tensor<4x3xi4>, tensor<4x3xi32>
// CHECK-NEXT:  %flat_grid = tcp.view %grid : tensor<4x3xi32> -> tensor<12xi32>
// CHECK:       %is_expert = ve.tag ge %flat_grid, %{{.*}} : tensor<12xi32> -> tensor<12xi4>
// CHECK-NEXT:  %expert_ids = ve.filter %flat_grid, %is_expert keep [1] along 0 pad -1 : tensor<12xi32>, tensor<12xi4> -> tensor<7xi32>
// CHECK-NEXT:  %route = moe.route %scatter_idx, %expert_ids : tensor<5x2xi32>, tensor<7xi32> -> !moe.route<T = 5, K = 2, E = 4, B = 2, G = 7>
// CHECK-NEXT:  %xb = moe.dispatch %x, %route : tensor<5x8xbf16>, !moe.route<T = 5, K = 2, E = 4, B = 2, G = 7> -> tensor<7x2x8xbf16>
// CHECK-NEXT:  func.return %xb : tensor<7x2x8xbf16>
