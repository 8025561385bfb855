// RUN: tcpc-opt %s -p lower-math | filecheck %s

// Softmax: max-subtracted, in f32, the row max and the sum taken along the axis (left to right,
// as the reference does), one rounding at the end.

func.func @router(%logits: tensor<16x8xbf16>) -> tensor<16x8xbf16> {
  %p = tmath.softmax %logits {axis = 1 : i64} : tensor<16x8xbf16> -> tensor<16x8xbf16>
  func.return %p : tensor<16x8xbf16>
}

// CHECK-LABEL: func.func @router
// CHECK-NEXT:  %[[X:.*]] = ve.widen %logits : tensor<16x8xbf16> -> tensor<16x8xf32>
// CHECK-NEXT:  %row_max = ve.reduce_max %[[X]] along 1 : tensor<16x8xf32> -> tensor<16xf32>
// CHECK-NEXT:  %[[M:.*]] = ve.broadcast %row_max along 1 : tensor<16xf32> -> tensor<16x8xf32>
// CHECK-NEXT:  %shifted = ve.sub %[[X]], %[[M]] : tensor<16x8xf32>
// CHECK-NEXT:  %exps = ve.exp %shifted : tensor<16x8xf32>
// CHECK-NEXT:  %row_sum = ve.reduce_sum %exps along 1 : tensor<16x8xf32> -> tensor<16xf32>
// CHECK-NEXT:  %[[S:.*]] = ve.broadcast %row_sum along 1 : tensor<16xf32> -> tensor<16x8xf32>
// CHECK-NEXT:  %[[P:.*]] = ve.div %exps, %[[S]] : tensor<16x8xf32>
// CHECK-NEXT:  %p = ve.narrow %[[P]] : tensor<16x8xf32> -> tensor<16x8xbf16>
// CHECK-NEXT:  func.return %p : tensor<16x8xbf16>

func.func @columns(%x: tensor<4x6xf32>) -> tensor<4x6xf32> {
  %p = tmath.softmax %x {axis = 0 : i64} : tensor<4x6xf32> -> tensor<4x6xf32>
  func.return %p : tensor<4x6xf32>
}

// CHECK-LABEL: func.func @columns
// CHECK-NEXT:  %row_max = ve.reduce_max %x along 0 : tensor<4x6xf32> -> tensor<6xf32>
// CHECK-NEXT:  %[[M:.*]] = ve.broadcast %row_max along 0 : tensor<6xf32> -> tensor<4x6xf32>
// CHECK:       %row_sum = ve.reduce_sum %exps along 0 : tensor<4x6xf32> -> tensor<6xf32>
// CHECK:       %p = ve.div %exps, %{{.*}} : tensor<4x6xf32>
// CHECK-NEXT:  func.return %p : tensor<4x6xf32>
