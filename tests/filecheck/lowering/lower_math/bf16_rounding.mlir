// RUN: tcpc-opt %s -p lower-math | filecheck %s

// bf16 rounding points: a bf16 operand is widened (exact), the op runs in f32, a bf16 result is
// narrowed (round to nearest even): once per op, as the reference rounds. silu is sigmoid and a
// multiply with no rounding between them (the reference's x * sigmoid(x) in f32).

func.func @swiglu(%g: tensor<4x8xbf16>, %u: tensor<4x8xbf16>) -> tensor<4x8xbf16> {
  %s = tmath.silu %g : tensor<4x8xbf16> -> tensor<4x8xbf16>
  %h = tmath.mul %s, %u : (tensor<4x8xbf16>, tensor<4x8xbf16>) -> tensor<4x8xbf16>
  func.return %h : tensor<4x8xbf16>
}

// CHECK-LABEL: func.func @swiglu
// CHECK-NEXT:  %[[G:.*]] = ve.widen %g : tensor<4x8xbf16> -> tensor<4x8xf32>
// CHECK-NEXT:  %sigmoid = ve.sigmoid %[[G]] : tensor<4x8xf32>
// CHECK-NEXT:  %[[P:.*]] = ve.mul %[[G]], %sigmoid : tensor<4x8xf32>
// CHECK-NEXT:  %s = ve.narrow %[[P]] : tensor<4x8xf32> -> tensor<4x8xbf16>
// CHECK-NEXT:  %[[S:.*]] = ve.widen %s : tensor<4x8xbf16> -> tensor<4x8xf32>
// CHECK-NEXT:  %[[U:.*]] = ve.widen %u : tensor<4x8xbf16> -> tensor<4x8xf32>
// CHECK-NEXT:  %[[H:.*]] = ve.mul %[[S]], %[[U]] : tensor<4x8xf32>
// CHECK-NEXT:  %h = ve.narrow %[[H]] : tensor<4x8xf32> -> tensor<4x8xbf16>
// CHECK-NEXT:  func.return %h : tensor<4x8xbf16>

// f32 needs no conversions; abs and neg are bit operations (exact for NaN and -0.0).

func.func @f32_chain(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
  %e = tmath.exp %x : tensor<4x8xf32> -> tensor<4x8xf32>
  %l = tmath.log %e : tensor<4x8xf32> -> tensor<4x8xf32>
  %t = tmath.tanh %l : tensor<4x8xf32> -> tensor<4x8xf32>
  %a = tmath.abs %t : tensor<4x8xf32> -> tensor<4x8xf32>
  %q = tmath.sqrt %a : tensor<4x8xf32> -> tensor<4x8xf32>
  %n = tmath.neg %q : tensor<4x8xf32> -> tensor<4x8xf32>
  %d = tmath.div %n, %x : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  func.return %d : tensor<4x8xf32>
}

// CHECK-LABEL: func.func @f32_chain
// CHECK-NEXT:  %e = ve.exp %x : tensor<4x8xf32>
// CHECK-NEXT:  %l = ve.log %e : tensor<4x8xf32>
// CHECK-NEXT:  %t = ve.tanh %l : tensor<4x8xf32>
// CHECK-NEXT:  %[[TB:.*]] = ve.bitcast %t : tensor<4x8xf32> -> tensor<4x8xi32>
// CHECK-NEXT:  %[[MAG:.*]] = ve.const 0x7fffffff : tensor<4x8xi32>
// CHECK-NEXT:  %[[AB:.*]] = ve.and %[[TB]], %[[MAG]] : tensor<4x8xi32>
// CHECK-NEXT:  %a = ve.bitcast %[[AB]] : tensor<4x8xi32> -> tensor<4x8xf32>
// CHECK-NEXT:  %q = ve.sqrt %a : tensor<4x8xf32>
// CHECK-NEXT:  %[[QB:.*]] = ve.bitcast %q : tensor<4x8xf32> -> tensor<4x8xi32>
// CHECK-NEXT:  %[[SIGN:.*]] = ve.const 0x80000000 : tensor<4x8xi32>
// CHECK-NEXT:  %[[NB:.*]] = ve.xor %[[QB]], %[[SIGN]] : tensor<4x8xi32>
// CHECK-NEXT:  %n = ve.bitcast %[[NB]] : tensor<4x8xi32> -> tensor<4x8xf32>
// CHECK-NEXT:  %d = ve.div %n, %x : tensor<4x8xf32>
// CHECK-NEXT:  func.return %d : tensor<4x8xf32>

// i32: neg is 0 - x, abs is max(x, 0 - x); both wrap at INT_MIN as numpy does.

func.func @int_neg_abs(%i: tensor<3xi32>) -> tensor<3xi32> {
  %n = tmath.neg %i : tensor<3xi32> -> tensor<3xi32>
  %a = tmath.abs %n : tensor<3xi32> -> tensor<3xi32>
  func.return %a : tensor<3xi32>
}

// CHECK-LABEL: func.func @int_neg_abs
// CHECK-NEXT:  %[[Z:.*]] = ve.const 0 : tensor<3xi32>
// CHECK-NEXT:  %n = ve.sub %[[Z]], %i : tensor<3xi32>
// CHECK-NEXT:  %[[Z2:.*]] = ve.const 0 : tensor<3xi32>
// CHECK-NEXT:  %[[M:.*]] = ve.sub %[[Z2]], %n : tensor<3xi32>
// CHECK-NEXT:  %a = ve.max %n, %[[M]] : tensor<3xi32>
