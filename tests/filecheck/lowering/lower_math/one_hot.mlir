// RUN: tcpc-opt %s -p lower-math | filecheck %s

// one_hot: the index broadcast along a new axis, tagged eq against an iota, 1 where it hits
// (an index outside [0, depth) hits nothing: a zero row).

func.func @kept_groups(%top_g: tensor<16x2xi32>) -> tensor<16x4xi32> {
  %o = tmath.one_hot %top_g : tensor<16x2xi32> -> tensor<16x2x4xi32>
  %k = tmath.reduce_sum %o {axes = array<i64: 1>} : tensor<16x2x4xi32> -> tensor<16x4xi32>
  func.return %k : tensor<16x4xi32>
}

// CHECK-LABEL: func.func @kept_groups
// CHECK-NEXT:  %[[I:.*]] = ve.broadcast %top_g along 2 : tensor<16x2xi32> -> tensor<16x2x4xi32>
// CHECK-NEXT:  %position = ve.iota along 2 : tensor<16x2x4xi32>
// CHECK-NEXT:  %hit = ve.tag eq %[[I]], %position : tensor<16x2x4xi32> -> tensor<16x2x4xi4>
// CHECK-NEXT:  %[[ONE:.*]] = ve.const 1 : tensor<16x2x4xi32>
// CHECK-NEXT:  %[[ZERO:.*]] = ve.const 0 : tensor<16x2x4xi32>
// CHECK-NEXT:  %o = ve.select %hit in [1], %[[ONE]], %[[ZERO]] : tensor<16x2x4xi4>, tensor<16x2x4xi32>
// CHECK-NEXT:  %k = ve.reduce_sum %o along 1 : tensor<16x2x4xi32> -> tensor<16x4xi32>
