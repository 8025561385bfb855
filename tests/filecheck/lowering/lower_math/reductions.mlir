// RUN: tcpc-opt %s -p lower-math | filecheck %s

// Reductions: one ve reduction per axis, the last axis first (the reference's order); keepdims
// is a view, and a view that is broadcast again is never materialised.

func.func @renormalise(%top_p: tensor<16x2xf32>) -> tensor<16x2xf32> {
  %s = tmath.reduce_sum %top_p {axes = array<i64: 1>, keepdims} : tensor<16x2xf32> -> tensor<16x1xf32>
  %w = tmath.div %top_p, %s : (tensor<16x2xf32>, tensor<16x1xf32>) -> tensor<16x2xf32>
  func.return %w : tensor<16x2xf32>
}

// CHECK-LABEL: func.func @renormalise
// CHECK-NEXT:  %[[S:.*]] = ve.reduce_sum %top_p along 1 : tensor<16x2xf32> -> tensor<16xf32>
// CHECK-NEXT:  %[[B:.*]] = ve.broadcast %[[S]] along 1 : tensor<16xf32> -> tensor<16x2xf32>
// CHECK-NEXT:  %w = ve.div %top_p, %[[B]] : tensor<16x2xf32>
// CHECK-NEXT:  func.return %w : tensor<16x2xf32>

func.func @several_axes(%x: tensor<2x3x4xbf16>) -> tensor<1x3x1xbf16> {
  %m = tmath.reduce_max %x {axes = array<i64: 0, 2>, keepdims} : tensor<2x3x4xbf16> -> tensor<1x3x1xbf16>
  func.return %m : tensor<1x3x1xbf16>
}

// CHECK-LABEL: func.func @several_axes
// CHECK-NEXT:  %[[X:.*]] = ve.widen %x : tensor<2x3x4xbf16> -> tensor<2x3x4xf32>
// CHECK-NEXT:  %[[A:.*]] = ve.reduce_max %[[X]] along 2 : tensor<2x3x4xf32> -> tensor<2x3xf32>
// CHECK-NEXT:  %[[B:.*]] = ve.reduce_max %[[A]] along 0 : tensor<2x3xf32> -> tensor<3xf32>
// CHECK-NEXT:  %[[V:.*]] = tcp.view %[[B]] : tensor<3xf32> -> tensor<1x3x1xf32>
// CHECK-NEXT:  %m = ve.narrow %[[V]] : tensor<1x3x1xf32> -> tensor<1x3x1xbf16>

func.func @counts(%x: tensor<2x3x4xi32>) -> tensor<i32> {
  %m = tmath.reduce_min %x {axes = array<i64: 0, 1, 2>} : tensor<2x3x4xi32> -> tensor<i32>
  func.return %m : tensor<i32>
}

// CHECK-LABEL: func.func @counts
// CHECK-NEXT:  %[[A:.*]] = ve.reduce_min %x along 2 : tensor<2x3x4xi32> -> tensor<2x3xi32>
// CHECK-NEXT:  %[[B:.*]] = ve.reduce_min %[[A]] along 1 : tensor<2x3xi32> -> tensor<2xi32>
// CHECK-NEXT:  %m = ve.reduce_min %[[B]] along 0 : tensor<2xi32> -> tensor<i32>
// CHECK-NEXT:  func.return %m : tensor<i32>
