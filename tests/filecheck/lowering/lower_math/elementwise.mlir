// RUN: tcpc-opt %s -p lower-math | filecheck %s
// RUN: tcpc-opt %s -p lower-math | tcpc-opt | filecheck %s
// RUN: tcpc-opt %s -p lower-math --print-op-generic | tcpc-opt | filecheck %s

// Elementwise arithmetic with implicit broadcasting made explicit: a view drops the size-1
// axis, one ve.broadcast per tiled axis; a scalar constant is a splat of the consumer's shape,
// rounded to its own type first (1.702 as bf16 is 1.703125); -0.0 stays -0.0.

func.func @bias_add(%h: tensor<4x1xbf16>, %bias: tensor<8xf32>) -> tensor<4x8xf32> {
  %y = tmath.add %h, %bias : (tensor<4x1xbf16>, tensor<8xf32>) -> tensor<4x8xf32>
  func.return %y : tensor<4x8xf32>
}

// CHECK-LABEL: func.func @bias_add
// CHECK-NEXT:  %[[W:.*]] = ve.widen %h : tensor<4x1xbf16> -> tensor<4x1xf32>
// CHECK-NEXT:  %[[V:.*]] = tcp.view %[[W]] : tensor<4x1xf32> -> tensor<4xf32>
// CHECK-NEXT:  %[[L:.*]] = ve.broadcast %[[V]] along 1 : tensor<4xf32> -> tensor<4x8xf32>
// CHECK-NEXT:  %[[R:.*]] = ve.broadcast %bias along 0 : tensor<8xf32> -> tensor<4x8xf32>
// CHECK-NEXT:  %y = ve.add %[[L]], %[[R]] : tensor<4x8xf32>
// CHECK-NEXT:  func.return %y : tensor<4x8xf32>

func.func @scale(%x: tensor<2x3xbf16>) -> tensor<2x3xbf16> {
  %c = tmath.constant 1.702 : tensor<bf16>
  %y = tmath.mul %x, %c : (tensor<2x3xbf16>, tensor<bf16>) -> tensor<2x3xbf16>
  %z = tmath.constant -0.0 : tensor<f32>
  %m = tmath.maximum %z, %x : (tensor<f32>, tensor<2x3xbf16>) -> tensor<2x3xf32>
  %n = tmath.cast %m : tensor<2x3xf32> -> tensor<2x3xbf16>
  %r = tmath.sub %y, %n : (tensor<2x3xbf16>, tensor<2x3xbf16>) -> tensor<2x3xbf16>
  func.return %r : tensor<2x3xbf16>
}


// CHECK-LABEL: func.func @scale
// CHECK-NOT:   tmath.
// CHECK:       %[[X:.*]] = ve.widen %x : tensor<2x3xbf16> -> tensor<2x3xf32>
// CHECK-NEXT:  %[[C:.*]] = ve.const 1.703125 : tensor<2x3xf32>
// CHECK-NEXT:  %[[P:.*]] = ve.mul %[[X]], %[[C]] : tensor<2x3xf32>
// CHECK-NEXT:  %y = ve.narrow %[[P]] : tensor<2x3xf32> -> tensor<2x3xbf16>
// CHECK-NEXT:  %[[Z:.*]] = ve.const -0.0 : tensor<2x3xf32>
// CHECK-NEXT:  %[[X2:.*]] = ve.widen %x : tensor<2x3xbf16> -> tensor<2x3xf32>
// CHECK-NEXT:  %m = ve.max %[[Z]], %[[X2]] : tensor<2x3xf32>
// CHECK-NEXT:  %n = ve.narrow %m : tensor<2x3xf32> -> tensor<2x3xbf16>
// CHECK-NEXT:  %[[A:.*]] = ve.widen %y : tensor<2x3xbf16> -> tensor<2x3xf32>
// CHECK-NEXT:  %[[B:.*]] = ve.widen %n : tensor<2x3xbf16> -> tensor<2x3xf32>
// CHECK-NEXT:  %[[D:.*]] = ve.sub %[[A]], %[[B]] : tensor<2x3xf32>
// CHECK-NEXT:  %r = ve.narrow %[[D]] : tensor<2x3xf32> -> tensor<2x3xbf16>
// CHECK-NEXT:  func.return %r : tensor<2x3xbf16>

func.func @ints(%a: tensor<5xi32>, %b: tensor<i32>) -> tensor<5xi32> {
  %s = tmath.mul %a, %b : (tensor<5xi32>, tensor<i32>) -> tensor<5xi32>
  %m = tmath.minimum %s, %a : (tensor<5xi32>, tensor<5xi32>) -> tensor<5xi32>
  func.return %m : tensor<5xi32>
}

// i32 stays in its lanes: no widening, no rounding.
// CHECK-LABEL: func.func @ints
// CHECK-NEXT:  %[[B:.*]] = ve.broadcast %b along 0 : tensor<i32> -> tensor<5xi32>
// CHECK-NEXT:  %s = ve.mul %a, %[[B]] : tensor<5xi32>
// CHECK-NEXT:  %m = ve.min %s, %a : tensor<5xi32>
// CHECK-NEXT:  func.return %m : tensor<5xi32>
