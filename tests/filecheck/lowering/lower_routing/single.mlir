// RUN: tcpc-opt %s -p lower-routing | filecheck %s

// One token, one expert: every scanned axis has a single element, which the position tag marks
// `single` (3); the scan neither reads nor writes it, so the cumsum passes it through. One block
// at most an expert: the ids are the experts with a positive count, compacted (no block grid),
// made before the pairs' offsets.

func.func @one(%x: tensor<1x4xbf16>, %idx: tensor<1x1xi32>) -> tensor<1x1x4xbf16> {
  %xb, %route = moe.scatter %x, %idx : tensor<1x4xbf16>, tensor<1x1xi32> -> tensor<1x1x4xbf16>, !moe.route<T = 1, K = 1, E = 1, B = 1, G = 1>
  func.return %xb : tensor<1x1x4xbf16>
}

// CHECK-LABEL: func.func @one
// CHECK:       %counts = ve.reduce_sum %expert_mask along 0
// CHECK:       %has_block = ve.tag gt %counts, %{{.*}} : tensor<1xi32> -> tensor<1xi4>
// CHECK-NEXT:  %block_expert = ve.iota along 0 : tensor<1xi32>
// CHECK-NEXT:  %expert_ids = ve.filter %block_expert, %has_block keep [1] along 0 pad -1 : tensor<1xi32>, tensor<1xi4> -> tensor<1xi32>
// CHECK:       %num_blocks = ve.min %counts, %{{.*}} : tensor<1xi32>
// CHECK-NOT:   %grid
// CHECK:       %expert_position = ve.position_tag along 0 first 0 middle 1 last 2 single 3 : tensor<1xi4>
// CHECK-NEXT:  ve.scan add %num_blocks, %expert_position along 0 read [1, 2] write [0, 1] : tensor<1xi32>, tensor<1xi4>
// CHECK:       %pair_position = ve.position_tag along 0 first 0 middle 1 last 2 single 3 : tensor<1x1xi4>
// CHECK-NEXT:  ve.scan add %expert_mask, %pair_position along 0 read [1, 2] write [0, 1] : tensor<1x1xi32>, tensor<1x1xi4>
// CHECK-NOT:   moe.scatter
