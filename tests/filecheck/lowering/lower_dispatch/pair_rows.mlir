// RUN: tcpc-opt %s -p lower-dispatch | filecheck %s

// pair_rows: where each pair sits in the blocks is the plan's scatter_idx itself (shard-experts'
// a2a receiver gathers a whole token's rows straight from the blocks by it); the moe.route
// it read goes with its last reader.

func.func @pair_rows(%scatter_idx: tensor<6x2xi32>, %expert_ids: tensor<4xi32>) -> tensor<6x2xi32> {
  %route = moe.route %scatter_idx, %expert_ids : tensor<6x2xi32>, tensor<4xi32> -> !moe.route<T = 6, K = 2, E = 4, B = 4, G = 4, C = 2>
  %rows = moe.pair_rows %route : !moe.route<T = 6, K = 2, E = 4, B = 4, G = 4, C = 2> -> tensor<6x2xi32>
  func.return %rows : tensor<6x2xi32>
}

// CHECK-LABEL: func.func @pair_rows(%scatter_idx: tensor<6x2xi32>, %expert_ids: tensor<4xi32>) -> tensor<6x2xi32> {
// CHECK-NEXT:    func.return %scatter_idx : tensor<6x2xi32>
// CHECK-NEXT:  }
