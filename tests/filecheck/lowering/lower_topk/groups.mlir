// RUN: tcpc-opt %s -p lower-topk | filecheck %s
// RUN: tcpc-opt %s -p 'lower-topk{strategy=rounds}' | filecheck %s --check-prefix=ROUNDS

// DeepSeek-V3's per-group top-2 on [T, G, E/G]: the last axis is ranked, any leading shape.

func.func @groups(%s: tensor<4x8x32xf32>) -> (tensor<4x8x2xf32>, tensor<4x8x2xi32>) {
  %v, %i = moe.topk %s {k = 2 : i64} : tensor<4x8x32xf32> -> tensor<4x8x2xf32>, tensor<4x8x2xi32>
  func.return %v, %i : tensor<4x8x2xf32>, tensor<4x8x2xi32>
}

// CHECK-LABEL: func.func @groups
// CHECK:       %index = ve.iota along 2 : tensor<4x8x32xi32>
// CHECK:       %key_i = ve.broadcast %key along 3 : tensor<4x8x32xi32> -> tensor<4x8x32x32xi32>
// CHECK-NEXT:  %key_j = ve.broadcast %key along 2 : tensor<4x8x32xi32> -> tensor<4x8x32x32xi32>
// CHECK:       %rank = ve.reduce_sum %{{.*}} along 3 : tensor<4x8x32x32xi32> -> tensor<4x8x32xi32>
// CHECK:       %top_values = ve.filter %bits, %chosen keep [1] along 2 pad 0 : tensor<4x8x32xi32>, tensor<4x8x32xi4> -> tensor<4x8x2xi32>
// CHECK:       %place = ve.tag eq %{{.*}}, %{{.*}} : tensor<4x8x2x2xi32> -> tensor<4x8x2x2xi4>
// CHECK:       %i = ve.reduce_sum %{{.*}} along 2 : tensor<4x8x2x2xi32> -> tensor<4x8x2xi32>
// CHECK:       func.return %v, %i : tensor<4x8x2xf32>, tensor<4x8x2xi32>

// ROUNDS-LABEL: func.func @groups
// ROUNDS-NOT:   x32x32x
// ROUNDS:       ve.reduce_max %key along 2 : tensor<4x8x32xi32> -> tensor<4x8xi32>
// ROUNDS:       %hit1 = ve.tag eq %index
// ROUNDS-NOT:   %hit2
// ROUNDS:       %top_values = ve.filter %bits, %chosen keep [1] along 2 pad 0 : tensor<4x8x32xi32>, tensor<4x8x32xi4> -> tensor<4x8x2xi32>
