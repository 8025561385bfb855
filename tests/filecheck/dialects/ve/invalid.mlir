// RUN: tcpc-opt %s --split-input-file --verify-diagnostics --parsing-diagnostics | filecheck %s

// The ve verifier's and parser's cases, ve.chain's among them: each split case is rejected with the message checked after it.

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.and %x, %x : tensor<4xf32>
  func.return
}

// CHECK: ve.and takes i32, not f32[4]

// -----

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.iota along 1 : tensor<4xi32>
  func.return
}

// CHECK: axis 1 is out of range for rank 1

// -----

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.bitcast %x : tensor<4xf32> -> tensor<4xf32>
  func.return
}

// CHECK: ve.bitcast changes the element type

// -----

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.bitcast %x : tensor<4xf32> -> tensor<5xi32>
  func.return
}

// CHECK: ve.bitcast keeps the shape: f32[4] -> i32[5]

// -----

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.widen %x : tensor<4xf32> -> tensor<4xf32>
  func.return
}

// CHECK: ve.widen does not take f32[4]

// -----

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.exp %i : tensor<4xi32>
  func.return
}

// CHECK: ve.exp takes f32

// -----

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.select %x in [1], %i, %i : tensor<4xf32>, tensor<4xi32>
  func.return
}

// CHECK: ve.select is guarded by a tag tensor, not f32[4]

// -----

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.select %t in [16], %i, %i : tensor<4xi4>, tensor<4xi32>
  func.return
}

// CHECK: select tags must lie in [0, 15], got [16]

// -----

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.select %t in [1, 1], %i, %i : tensor<4xi4>, tensor<4xi32>
  func.return
}

// CHECK: select tags must be distinct, got [1, 1]

// -----

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.tag eq %t, %t : tensor<4xi4> -> tensor<4xi4>
  func.return
}

// CHECK: ve.tag compares i32 or f32, not i4[4]

// -----

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.position_tag along 0 first 0 middle 1 last 2 single 20 : tensor<4xi4>
  func.return
}

// CHECK: position tags must lie in [0, 15], got [0, 1, 2, 20]

// -----

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.scan add %i, %t along 1 read [1] write [0] : tensor<4xi32>, tensor<4xi4>
  func.return
}

// CHECK: axis 1 is out of range for rank 1

// -----

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.broadcast %i along 0 : tensor<4xi32> -> tensor<4x3xi32>
  func.return
}

// CHECK: i32[4, 3] is not i32[4] with an axis inserted at 0

// -----

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.reduce_sum %i along 0 : tensor<4xi32> -> tensor<1xi32>
  func.return
}

// CHECK: ve.reduce_sum along 0 gives tensor<i32>

// -----

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.filter %i, %t keep [1] along 0 pad 4294967295 : tensor<4xi32>, tensor<4xi4> -> tensor<2xi32>
  func.return
}

// CHECK: pad 4294967295 is not a 32-bit value

// -----

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.filter %i, %t keep [1] along 0 pad 0 : tensor<4xi32>, tensor<4xi4> -> tensor<2xf32>
  func.return
}

// CHECK: f32[2] is not i32[4] with axis 0 resized

// -----

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.const 1.5 : tensor<4xi32>
  func.return
}

// CHECK: ve.const: an i32 const needs an integer

// -----

func.func @f(%x: tensor<4xf32>, %i: tensor<4xi32>, %t: tensor<4xi4>) {
  %r = ve.const 1 : tensor<4xi4>
  func.return
}

// CHECK: ve.const gives i32 or f32, not i4[4]

// -----

func.func @chain_illegal(%x: tensor<8xf32>) {
  %r = ve.chain (%a = %x) : (tensor<8xf32>) -> tensor<8xf32> {
    %s = ve.sigmoid %a : tensor<8xf32>
    %t = ve.tanh %s : tensor<8xf32>
    ve.yield %t : tensor<8xf32>
  }
  func.return
}

// CHECK: ve.chain cannot run as one invocation: ve.tanh needs Float (FpFpu), taken or earlier in the chain than the ops before it

// -----

func.func @chain_yield_type(%x: tensor<8xf32>) {
  %r = ve.chain (%a = %x) : (tensor<8xf32>) -> tensor<8xbf16> {
    %s = ve.sigmoid %a : tensor<8xf32>
    ve.yield %s : tensor<8xf32>
  }
  func.return
}

// CHECK: ve.chain yields f32[8] but gives bf16[8]

// -----

func.func @chain_yields_last(%x: tensor<8xf32>) {
  %r = ve.chain (%a = %x) : (tensor<8xf32>) -> tensor<8xf32> {
    %s = ve.sigmoid %a : tensor<8xf32>
    %e = ve.exp %a : tensor<8xf32>
    ve.yield %s : tensor<8xf32>
  }
  func.return
}

// CHECK: ve.chain yields its last op's result

// -----

func.func @lookup_table(%c: tensor<2x5xui3>, %g: tensor<3x8xf32>) {
  %v = ve.lookup %c in %g : tensor<2x5xui3>, tensor<3x8xf32> -> tensor<2x5xf32>
  func.return
}

// CHECK: ve.lookup's table must be f32 [8] or [2, 8] (an entry per code, a table per row), got f32[3, 8]

// -----

func.func @repeat_cut(%s: tensor<2x2xf32>) {
  %r = ve.repeat %s along 1 times 4 : tensor<2x2xf32> -> tensor<2x9xf32>
  func.return
}

// CHECK: f32[2, 9] is not f32[2, 2] repeated 4 times along 1 and cut
