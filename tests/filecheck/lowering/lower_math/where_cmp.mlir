// RUN: tcpc-opt %s -p lower-math | filecheck %s
// RUN: tcpc-opt %s -p lower-math | tcpc-opt | filecheck %s
// RUN: tcpc-opt %s -p lower-math --print-op-generic | tcpc-opt | filecheck %s

// cmp becomes a tag stream (ve.tag: 1 where true), which a select reads; booleans broadcast like
// values (a view, then ve.broadcast of the tags). Scalar constants are splats.

func.func @mask_groups(%keep: tensor<16x4x1xi32>, %grouped: tensor<16x4x4xf32>) -> tensor<16x4x4xf32> {
  %zero = tmath.constant 0 : tensor<i32>
  %c = tmath.cmp "gt", %keep, %zero : (tensor<16x4x1xi32>, tensor<i32>) -> tensor<16x4x1xi1>
  %ninf = tmath.constant -inf : tensor<f32>
  %m = tmath.select %c, %grouped, %ninf : (tensor<16x4x1xi1>, tensor<16x4x4xf32>, tensor<f32>) -> tensor<16x4x4xf32>
  func.return %m : tensor<16x4x4xf32>
}

// CHECK-LABEL: func.func @mask_groups
// CHECK-NEXT:  %[[Z:.*]] = ve.const 0 : tensor<16x4x1xi32>
// CHECK-NEXT:  %c = ve.tag gt %keep, %[[Z]] : tensor<16x4x1xi32> -> tensor<16x4x1xi4>
// CHECK-NEXT:  %[[V:.*]] = tcp.view %c : tensor<16x4x1xi4> -> tensor<16x4xi4>
// CHECK-NEXT:  %[[T:.*]] = ve.broadcast %[[V]] along 2 : tensor<16x4xi4> -> tensor<16x4x4xi4>
// CHECK-NEXT:  %[[NINF:.*]] = ve.const -inf : tensor<16x4x4xf32>
// CHECK-NEXT:  %m = ve.select %[[T]] in [1], %grouped, %[[NINF]] : tensor<16x4x4xi4>, tensor<16x4x4xf32>
// CHECK-NEXT:  func.return %m : tensor<16x4x4xf32>

// bf16 against f32 compares in f32; bf16 branches are widened and the result narrowed.

func.func @mixed(%a: tensor<4xbf16>, %b: tensor<4xf32>, %x: tensor<4xbf16>, %y: tensor<4xbf16>) -> tensor<4xbf16> {
  %c = tmath.cmp "ne", %a, %b : (tensor<4xbf16>, tensor<4xf32>) -> tensor<4xi1>
  %r = tmath.select %c, %x, %y : (tensor<4xi1>, tensor<4xbf16>, tensor<4xbf16>) -> tensor<4xbf16>
  func.return %r : tensor<4xbf16>
}

// CHECK-LABEL: func.func @mixed
// CHECK-NEXT:  %[[A:.*]] = ve.widen %a : tensor<4xbf16> -> tensor<4xf32>
// CHECK-NEXT:  %c = ve.tag ne %[[A]], %b : tensor<4xf32> -> tensor<4xi4>
// CHECK-NEXT:  %[[X:.*]] = ve.widen %x : tensor<4xbf16> -> tensor<4xf32>
// CHECK-NEXT:  %[[Y:.*]] = ve.widen %y : tensor<4xbf16> -> tensor<4xf32>
// CHECK-NEXT:  %[[R:.*]] = ve.select %c in [1], %[[X]], %[[Y]] : tensor<4xi4>, tensor<4xf32>
// CHECK-NEXT:  %r = ve.narrow %[[R]] : tensor<4xf32> -> tensor<4xbf16>

// A constant that no lowered op absorbs (here returned) becomes a splat, narrowed for bf16.

func.func @returned_constant() -> tensor<2xbf16> {
  %c = tmath.constant 1.702 : tensor<2xbf16>
  func.return %c : tensor<2xbf16>
}

// CHECK-LABEL: func.func @returned_constant
// CHECK-NEXT:  %[[C:.*]] = ve.const 1.703125 : tensor<2xf32>
// CHECK-NEXT:  %c = ve.narrow %[[C]] : tensor<2xf32> -> tensor<2xbf16>
// CHECK-NEXT:  func.return %c : tensor<2xbf16>
