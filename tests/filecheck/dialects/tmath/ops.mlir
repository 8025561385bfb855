// RUN: tcpc-opt %s | filecheck %s
// RUN: tcpc-opt %s --print-op-generic | tcpc-opt | filecheck %s

// Every tmath op in its custom format, printed back unchanged and through the generic format.

func.func @elementwise(%x: tensor<4x8xf32>, %h: tensor<4x1xbf16>, %bias: tensor<8xf32>, %i: tensor<5xi32>, %j: tensor<5xi32>) -> tensor<4x8xf32> {
  %zero = tmath.constant 0 : tensor<i32>
  %half = tmath.constant 0.5 : tensor<bf16>
  %ninf = tmath.constant -inf : tensor<f32>
  %y = tmath.add %h, %bias : (tensor<4x1xbf16>, tensor<8xf32>) -> tensor<4x8xf32>
  %r = tmath.sub %y, %x : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %p = tmath.mul %r, %half : (tensor<4x8xf32>, tensor<bf16>) -> tensor<4x8xf32>
  %d = tmath.div %p, %x : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %mx = tmath.maximum %ninf, %d : (tensor<f32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %mn = tmath.minimum %i, %j : (tensor<5xi32>, tensor<5xi32>) -> tensor<5xi32>
  %e = tmath.exp %mx : tensor<4x8xf32> -> tensor<4x8xf32>
  %l = tmath.log %e : tensor<4x8xf32> -> tensor<4x8xf32>
  %t = tmath.tanh %l : tensor<4x8xf32> -> tensor<4x8xf32>
  %a = tmath.abs %t : tensor<4x8xf32> -> tensor<4x8xf32>
  %q = tmath.sqrt %a : tensor<4x8xf32> -> tensor<4x8xf32>
  %n = tmath.neg %q : tensor<4x8xf32> -> tensor<4x8xf32>
  %s = tmath.sigmoid %n : tensor<4x8xf32> -> tensor<4x8xf32>
  %g = tmath.silu %s : tensor<4x8xf32> -> tensor<4x8xf32>
  %c = tmath.cmp "gt", %g, %ninf : (tensor<4x8xf32>, tensor<f32>) -> tensor<4x8xi1>
  %m = tmath.select %c, %g, %ninf : (tensor<4x8xi1>, tensor<4x8xf32>, tensor<f32>) -> tensor<4x8xf32>
  func.return %m : tensor<4x8xf32>
}
func.func @routing(%logits: tensor<16x8xbf16>, %w: tensor<64x8xf32>, %xf: tensor<16x64xf32>, %top_e: tensor<16x2xi32>) -> (tensor<16x2x8xi32>, tensor<16x2xf32>, tensor<i32>) {
  %l = tmath.matmul %xf, %w : (tensor<16x64xf32>, tensor<64x8xf32>) -> tensor<16x8xf32>
  %p = tmath.softmax %logits {axis = 1 : i64} : tensor<16x8xbf16> -> tensor<16x8xbf16>
  %pf = tmath.cast %p : tensor<16x8xbf16> -> tensor<16x8xf32>
  %t = tmath.take %pf, %top_e : (tensor<16x8xf32>, tensor<16x2xi32>) -> tensor<16x2xf32>
  %s = tmath.reduce_sum %t {axes = array<i64: 1>, keepdims} : tensor<16x2xf32> -> tensor<16x1xf32>
  %mx = tmath.reduce_max %l {axes = array<i64: 0>} : tensor<16x8xf32> -> tensor<8xf32>
  %mn = tmath.reduce_min %top_e {axes = array<i64: 0, 1>} : tensor<16x2xi32> -> tensor<i32>
  %o = tmath.one_hot %top_e : tensor<16x2xi32> -> tensor<16x2x8xi32>
  %g = tmath.reshape %l : tensor<16x8xf32> -> tensor<16x2x4xf32>
  func.return %o, %t, %mn : tensor<16x2x8xi32>, tensor<16x2xf32>, tensor<i32>
}

// CHECK:      func.func @elementwise(%x: tensor<4x8xf32>, %h: tensor<4x1xbf16>, %bias: tensor<8xf32>, %i: tensor<5xi32>, %j: tensor<5xi32>) -> tensor<4x8xf32> {
// CHECK-NEXT:   %zero = tmath.constant 0 : tensor<i32>
// CHECK-NEXT:   %half = tmath.constant 0.5 : tensor<bf16>
// CHECK-NEXT:   %ninf = tmath.constant -inf : tensor<f32>
// CHECK-NEXT:   %y = tmath.add %h, %bias : (tensor<4x1xbf16>, tensor<8xf32>) -> tensor<4x8xf32>
// CHECK-NEXT:   %r = tmath.sub %y, %x : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
// CHECK-NEXT:   %p = tmath.mul %r, %half : (tensor<4x8xf32>, tensor<bf16>) -> tensor<4x8xf32>
// CHECK-NEXT:   %d = tmath.div %p, %x : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
// CHECK-NEXT:   %mx = tmath.maximum %ninf, %d : (tensor<f32>, tensor<4x8xf32>) -> tensor<4x8xf32>
// CHECK-NEXT:   %mn = tmath.minimum %i, %j : (tensor<5xi32>, tensor<5xi32>) -> tensor<5xi32>
// CHECK-NEXT:   %e = tmath.exp %mx : tensor<4x8xf32> -> tensor<4x8xf32>
// CHECK-NEXT:   %l = tmath.log %e : tensor<4x8xf32> -> tensor<4x8xf32>
// CHECK-NEXT:   %t = tmath.tanh %l : tensor<4x8xf32> -> tensor<4x8xf32>
// CHECK-NEXT:   %a = tmath.abs %t : tensor<4x8xf32> -> tensor<4x8xf32>
// CHECK-NEXT:   %q = tmath.sqrt %a : tensor<4x8xf32> -> tensor<4x8xf32>
// CHECK-NEXT:   %n = tmath.neg %q : tensor<4x8xf32> -> tensor<4x8xf32>
// CHECK-NEXT:   %s = tmath.sigmoid %n : tensor<4x8xf32> -> tensor<4x8xf32>
// CHECK-NEXT:   %g = tmath.silu %s : tensor<4x8xf32> -> tensor<4x8xf32>
// CHECK-NEXT:   %c = tmath.cmp "gt", %g, %ninf : (tensor<4x8xf32>, tensor<f32>) -> tensor<4x8xi1>
// CHECK-NEXT:   %m = tmath.select %c, %g, %ninf : (tensor<4x8xi1>, tensor<4x8xf32>, tensor<f32>) -> tensor<4x8xf32>
// CHECK-NEXT:   func.return %m : tensor<4x8xf32>
// CHECK-NEXT: }
// CHECK:      func.func @routing(%logits: tensor<16x8xbf16>, %w: tensor<64x8xf32>, %xf: tensor<16x64xf32>, %top_e: tensor<16x2xi32>) -> (tensor<16x2x8xi32>, tensor<16x2xf32>, tensor<i32>) {
// CHECK-NEXT:   %l = tmath.matmul %xf, %w : (tensor<16x64xf32>, tensor<64x8xf32>) -> tensor<16x8xf32>
// CHECK-NEXT:   %p = tmath.softmax %logits {axis = 1 : i64} : tensor<16x8xbf16> -> tensor<16x8xbf16>
// CHECK-NEXT:   %pf = tmath.cast %p : tensor<16x8xbf16> -> tensor<16x8xf32>
// CHECK-NEXT:   %t = tmath.take %pf, %top_e : (tensor<16x8xf32>, tensor<16x2xi32>) -> tensor<16x2xf32>
// CHECK-NEXT:   %s = tmath.reduce_sum %t {axes = array<i64: 1>, keepdims} : tensor<16x2xf32> -> tensor<16x1xf32>
// CHECK-NEXT:   %mx = tmath.reduce_max %l {axes = array<i64: 0>} : tensor<16x8xf32> -> tensor<8xf32>
// CHECK-NEXT:   %mn = tmath.reduce_min %top_e {axes = array<i64: 0, 1>} : tensor<16x2xi32> -> tensor<i32>
// CHECK-NEXT:   %o = tmath.one_hot %top_e : tensor<16x2xi32> -> tensor<16x2x8xi32>
// CHECK-NEXT:   %g = tmath.reshape %l : tensor<16x8xf32> -> tensor<16x2x4xf32>
// CHECK-NEXT:   func.return %o, %t, %mn : tensor<16x2x8xi32>, tensor<16x2xf32>, tensor<i32>
// CHECK-NEXT: }
