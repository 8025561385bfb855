// RUN: tcpc-opt %s | filecheck %s
// RUN: tcpc-opt %s --print-op-generic | tcpc-opt | filecheck %s

// Every ve op in its custom format, printed back and through the generic format. ve.const prints
// an i32 of magnitude 2^16 or more in hex (a mask): -2147483648 comes back as 0x80000000.

func.func @f(%x: tensor<3x4xi32>, %y: tensor<3x4xf32>, %h: tensor<3x4xbf16>) -> tensor<3x4xi32> {
  %c = ve.const 0x7fff0000 : tensor<3x4xi32>
  %n = ve.const -2147483648 : tensor<3x4xi32>
  %m = ve.const -5 : tensor<3x4xi32>
  %f = ve.const -inf : tensor<3x4xf32>
  %g = ve.const 1.5 : tensor<3x4xf32>
  %i = ve.iota along 1 : tensor<3x4xi32>
  %a0 = ve.and %x, %c : tensor<3x4xi32>
  %a1 = ve.or %x, %c : tensor<3x4xi32>
  %a2 = ve.xor %x, %c : tensor<3x4xi32>
  %a3 = ve.shl %x, %i : tensor<3x4xi32>
  %a4 = ve.shr_u %x, %i : tensor<3x4xi32>
  %a5 = ve.shr_s %x, %i : tensor<3x4xi32>
  %a6 = ve.add %x, %i : tensor<3x4xi32>
  %a7 = ve.sub %x, %i : tensor<3x4xi32>
  %a8 = ve.mul %x, %i : tensor<3x4xi32>
  %a9 = ve.max %x, %i : tensor<3x4xi32>
  %a10 = ve.min %x, %i : tensor<3x4xi32>
  %b0 = ve.add %y, %g : tensor<3x4xf32>
  %b1 = ve.div %y, %g : tensor<3x4xf32>
  %b2 = ve.exp %y : tensor<3x4xf32>
  %b3 = ve.sigmoid %y : tensor<3x4xf32>
  %b4 = ve.log %y : tensor<3x4xf32>
  %b5 = ve.sqrt %y : tensor<3x4xf32>
  %b6 = ve.tanh %y : tensor<3x4xf32>
  %t = ve.tag gt %x, %i : tensor<3x4xi32> -> tensor<3x4xi4>
  %tf = ve.tag ne %y, %g : tensor<3x4xf32> -> tensor<3x4xi4>
  %p = ve.position_tag along 1 first 0 middle 1 last 2 single 3 : tensor<3x4xi4>
  %s = ve.select %t in [1, 2], %a2, %x : tensor<3x4xi4>, tensor<3x4xi32>
  %cs = ve.scan add %s, %p along 1 read [1, 2] write [0, 1] : tensor<3x4xi32>, tensor<3x4xi4>
  %cm = ve.scan max %y, %p along 0 read [1, 2] write [0, 1] : tensor<3x4xf32>, tensor<3x4xi4>
  %bb = ve.broadcast %cs along 2 : tensor<3x4xi32> -> tensor<3x4x5xi32>
  %bt = ve.broadcast %t along 0 : tensor<3x4xi4> -> tensor<2x3x4xi4>
  %r0 = ve.reduce_sum %bb along 2 : tensor<3x4x5xi32> -> tensor<3x4xi32>
  %r1 = ve.reduce_max %y along 0 : tensor<3x4xf32> -> tensor<4xf32>
  %r2 = ve.reduce_min %x along 1 : tensor<3x4xi32> -> tensor<3xi32>
  %fl = ve.filter %r0, %t keep [1] along 1 pad -1 : tensor<3x4xi32>, tensor<3x4xi4> -> tensor<3x2xi32>
  %bc = ve.bitcast %r0 : tensor<3x4xi32> -> tensor<3x4xf32>
  %nb = ve.narrow %bc truncate : tensor<3x4xf32> -> tensor<3x4xbf16>
  %nr = ve.narrow %bc : tensor<3x4xf32> -> tensor<3x4xbf16>
  %w = ve.widen %h : tensor<3x4xbf16> -> tensor<3x4xf32>
  %fx = ve.fp_to_fxp %w : tensor<3x4xf32> -> tensor<3x4xi32>
  %fp = ve.fxp_to_fp %fx : tensor<3x4xi32> -> tensor<3x4xf32>
  func.return %r0 : tensor<3x4xi32>
}
func.func @low(%q: tensor<4xf8E4M3FN>, %v: tensor<4xf32>) -> tensor<4xf8E4M3FN> {
  %w = ve.widen_low %q : tensor<4xf8E4M3FN> -> tensor<4xf32>
  %s = ve.add %w, %v : tensor<4xf32>
  %n = ve.narrow_low %s : tensor<4xf32> -> tensor<4xf8E4M3FN>
  func.return %n : tensor<4xf8E4M3FN>
}
func.func @codes(%c: tensor<2x5x3xui3>, %g: tensor<2x8xf32>, %s: tensor<2x2x3xf32>) -> tensor<2x5x3xf32> {
  %v = ve.lookup %c in %g : tensor<2x5x3xui3>, tensor<2x8xf32> -> tensor<2x5x3xf32>
  %r = ve.repeat %s along 1 times 4 : tensor<2x2x3xf32> -> tensor<2x5x3xf32>
  %m = ve.mul %v, %r : tensor<2x5x3xf32>
  func.return %m : tensor<2x5x3xf32>
}
func.func @chain(%y_bf16: tensor<64xbf16>) -> tensor<64xbf16> {
  %h = ve.chain (%x = %y_bf16) : (tensor<64xbf16>) -> tensor<64xbf16> {
    %y = ve.widen %x : tensor<64xbf16> -> tensor<64xf32>
    %s = ve.sigmoid %y : tensor<64xf32>
    %m = ve.mul %y, %s : tensor<64xf32>
    %o = ve.narrow %m : tensor<64xf32> -> tensor<64xbf16>
    ve.yield %o : tensor<64xbf16>
  }
  func.return %h : tensor<64xbf16>
}

// CHECK:      func.func @f(%x: tensor<3x4xi32>, %y: tensor<3x4xf32>, %h: tensor<3x4xbf16>) -> tensor<3x4xi32> {
// CHECK-NEXT:   %c = ve.const 0x7fff0000 : tensor<3x4xi32>
// CHECK-NEXT:   %n = ve.const 0x80000000 : tensor<3x4xi32>
// CHECK-NEXT:   %m = ve.const -5 : tensor<3x4xi32>
// CHECK-NEXT:   %f = ve.const -inf : tensor<3x4xf32>
// CHECK-NEXT:   %g = ve.const 1.5 : tensor<3x4xf32>
// CHECK-NEXT:   %i = ve.iota along 1 : tensor<3x4xi32>
// CHECK-NEXT:   %a0 = ve.and %x, %c : tensor<3x4xi32>
// CHECK-NEXT:   %a1 = ve.or %x, %c : tensor<3x4xi32>
// CHECK-NEXT:   %a2 = ve.xor %x, %c : tensor<3x4xi32>
// CHECK-NEXT:   %a3 = ve.shl %x, %i : tensor<3x4xi32>
// CHECK-NEXT:   %a4 = ve.shr_u %x, %i : tensor<3x4xi32>
// CHECK-NEXT:   %a5 = ve.shr_s %x, %i : tensor<3x4xi32>
// CHECK-NEXT:   %a6 = ve.add %x, %i : tensor<3x4xi32>
// CHECK-NEXT:   %a7 = ve.sub %x, %i : tensor<3x4xi32>
// CHECK-NEXT:   %a8 = ve.mul %x, %i : tensor<3x4xi32>
// CHECK-NEXT:   %a9 = ve.max %x, %i : tensor<3x4xi32>
// CHECK-NEXT:   %a10 = ve.min %x, %i : tensor<3x4xi32>
// CHECK-NEXT:   %b0 = ve.add %y, %g : tensor<3x4xf32>
// CHECK-NEXT:   %b1 = ve.div %y, %g : tensor<3x4xf32>
// CHECK-NEXT:   %b2 = ve.exp %y : tensor<3x4xf32>
// CHECK-NEXT:   %b3 = ve.sigmoid %y : tensor<3x4xf32>
// CHECK-NEXT:   %b4 = ve.log %y : tensor<3x4xf32>
// CHECK-NEXT:   %b5 = ve.sqrt %y : tensor<3x4xf32>
// CHECK-NEXT:   %b6 = ve.tanh %y : tensor<3x4xf32>
// CHECK-NEXT:   %t = ve.tag gt %x, %i : tensor<3x4xi32> -> tensor<3x4xi4>
// CHECK-NEXT:   %tf = ve.tag ne %y, %g : tensor<3x4xf32> -> tensor<3x4xi4>
// CHECK-NEXT:   %p = ve.position_tag along 1 first 0 middle 1 last 2 single 3 : tensor<3x4xi4>
// CHECK-NEXT:   %s = ve.select %t in [1, 2], %a2, %x : tensor<3x4xi4>, tensor<3x4xi32>
// CHECK-NEXT:   %cs = ve.scan add %s, %p along 1 read [1, 2] write [0, 1] : tensor<3x4xi32>, tensor<3x4xi4>
// CHECK-NEXT:   %cm = ve.scan max %y, %p along 0 read [1, 2] write [0, 1] : tensor<3x4xf32>, tensor<3x4xi4>
// CHECK-NEXT:   %bb = ve.broadcast %cs along 2 : tensor<3x4xi32> -> tensor<3x4x5xi32>
// CHECK-NEXT:   %bt = ve.broadcast %t along 0 : tensor<3x4xi4> -> tensor<2x3x4xi4>
// CHECK-NEXT:   %r0 = ve.reduce_sum %bb along 2 : tensor<3x4x5xi32> -> tensor<3x4xi32>
// CHECK-NEXT:   %r1 = ve.reduce_max %y along 0 : tensor<3x4xf32> -> tensor<4xf32>
// CHECK-NEXT:   %r2 = ve.reduce_min %x along 1 : tensor<3x4xi32> -> tensor<3xi32>
// CHECK-NEXT:   %fl = ve.filter %r0, %t keep [1] along 1 pad -1 : tensor<3x4xi32>, tensor<3x4xi4> -> tensor<3x2xi32>
// CHECK-NEXT:   %bc = ve.bitcast %r0 : tensor<3x4xi32> -> tensor<3x4xf32>
// CHECK-NEXT:   %nb = ve.narrow %bc truncate : tensor<3x4xf32> -> tensor<3x4xbf16>
// CHECK-NEXT:   %nr = ve.narrow %bc : tensor<3x4xf32> -> tensor<3x4xbf16>
// CHECK-NEXT:   %w = ve.widen %h : tensor<3x4xbf16> -> tensor<3x4xf32>
// CHECK-NEXT:   %fx = ve.fp_to_fxp %w : tensor<3x4xf32> -> tensor<3x4xi32>
// CHECK-NEXT:   %fp = ve.fxp_to_fp %fx : tensor<3x4xi32> -> tensor<3x4xf32>
// CHECK-NEXT:   func.return %r0 : tensor<3x4xi32>
// CHECK-NEXT: }
// CHECK:      func.func @low(%q: tensor<4xf8E4M3FN>, %v: tensor<4xf32>) -> tensor<4xf8E4M3FN> {
// CHECK-NEXT:   %w = ve.widen_low %q : tensor<4xf8E4M3FN> -> tensor<4xf32>
// CHECK-NEXT:   %s = ve.add %w, %v : tensor<4xf32>
// CHECK-NEXT:   %n = ve.narrow_low %s : tensor<4xf32> -> tensor<4xf8E4M3FN>
// CHECK-NEXT:   func.return %n : tensor<4xf8E4M3FN>
// CHECK-NEXT: }
// CHECK:      func.func @codes(%c: tensor<2x5x3xui3>, %g: tensor<2x8xf32>, %s: tensor<2x2x3xf32>) -> tensor<2x5x3xf32> {
// CHECK-NEXT:   %v = ve.lookup %c in %g : tensor<2x5x3xui3>, tensor<2x8xf32> -> tensor<2x5x3xf32>
// CHECK-NEXT:   %r = ve.repeat %s along 1 times 4 : tensor<2x2x3xf32> -> tensor<2x5x3xf32>
// CHECK-NEXT:   %m = ve.mul %v, %r : tensor<2x5x3xf32>
// CHECK-NEXT:   func.return %m : tensor<2x5x3xf32>
// CHECK-NEXT: }
// CHECK:      func.func @chain(%y_bf16: tensor<64xbf16>) -> tensor<64xbf16> {
// CHECK-NEXT:   %h = ve.chain (%x = %y_bf16) : (tensor<64xbf16>) -> tensor<64xbf16> {
// CHECK-NEXT:     %y = ve.widen %x : tensor<64xbf16> -> tensor<64xf32>
// CHECK-NEXT:     %s = ve.sigmoid %y : tensor<64xf32>
// CHECK-NEXT:     %m = ve.mul %y, %s : tensor<64xf32>
// CHECK-NEXT:     %o = ve.narrow %m : tensor<64xf32> -> tensor<64xbf16>
// CHECK-NEXT:     ve.yield %o : tensor<64xbf16>
// CHECK-NEXT:   }
// CHECK-NEXT:   func.return %h : tensor<64xbf16>
// CHECK-NEXT: }
