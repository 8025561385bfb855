// RUN: tcpc-opt %s -p lower-topk | filecheck %s

// i32 scores are their own key; index order skips the placement step.

func.func @pick(%x: tensor<4x6xi32>) -> (tensor<4x3xi32>, tensor<4x3xi32>) {
  %v, %i = moe.topk %x {k = 3 : i64, order = "index"} : tensor<4x6xi32> -> tensor<4x3xi32>, tensor<4x3xi32>
  func.return %v, %i : tensor<4x3xi32>, tensor<4x3xi32>
}

// CHECK-LABEL: func.func @pick
// CHECK:       %index = ve.iota along 1 : tensor<4x6xi32>
// CHECK-NEXT:  %key_i = ve.broadcast %x along 2 : tensor<4x6xi32> -> tensor<4x6x6xi32>
// CHECK-NEXT:  %key_j = ve.broadcast %x along 1 : tensor<4x6xi32> -> tensor<4x6x6xi32>
// CHECK-NEXT:  %beats = ve.tag gt %key_j, %key_i
// CHECK:       %ties = ve.tag eq %key_j, %key_i
// CHECK:       %rank = ve.reduce_sum %{{.*}} along 2 : tensor<4x6x6xi32> -> tensor<4x6xi32>
// CHECK:       %chosen = ve.tag lt %rank
// CHECK-NEXT:  %v = ve.filter %x, %chosen keep [1] along 1 pad 0 : tensor<4x6xi32>, tensor<4x6xi4> -> tensor<4x3xi32>
// CHECK-NEXT:  %i = ve.filter %index, %chosen keep [1] along 1 pad 0 : tensor<4x6xi32>, tensor<4x6xi4> -> tensor<4x3xi32>
// CHECK-NEXT:  func.return %v, %i : tensor<4x3xi32>, tensor<4x3xi32>
// CHECK-NOT:   %place
