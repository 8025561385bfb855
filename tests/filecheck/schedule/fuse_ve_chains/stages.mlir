// RUN: tcpc-opt %s -p fuse-ve-chains | filecheck %s

// What does not fuse (dialects/ve_stages.py): a stage earlier than the one before it, an ALU
// used twice, an intermediate result read outside the chain, ops that never join a chain.

// Clip (max) then Fxp (add): the chain cannot go back to an earlier stage.
func.func @order(%x: tensor<64xi32>, %y: tensor<64xi32>) -> tensor<64xi32> {
  %a = ve.max %x, %y : tensor<64xi32>
  %b = ve.mul %a, %y : tensor<64xi32>
  func.return %b : tensor<64xi32>
}
// CHECK-LABEL: func.func @order
// CHECK-NOT:   ve.chain
// CHECK:       func.return

// Two exps both need the Float cluster's FpExp: the first pair fuses, the second exp starts
// a chain of its own (with nothing after it, so it stays alone).
func.func @alu_twice(%x: tensor<64xf32>) -> tensor<64xf32> {
  %a = ve.exp %x : tensor<64xf32>
  %b = ve.sqrt %a : tensor<64xf32>
  %c = ve.exp %b : tensor<64xf32>
  func.return %c : tensor<64xf32>
}
// CHECK-LABEL: func.func @alu_twice
// CHECK-NEXT:  %b = ve.chain
// CHECK-NEXT:    %a = ve.exp
// CHECK-NEXT:    %[[B:.*]] = ve.sqrt %a
// CHECK-NEXT:    ve.yield %[[B]]
// CHECK-NEXT:  }
// CHECK-NEXT:  %c = ve.exp %b
// CHECK-NEXT:  func.return %c

// %a is read after the chain would end: it must reach SRAM, so it ends no chain in the middle.
func.func @escapes(%x: tensor<64xf32>, %y: tensor<64xf32>) -> (tensor<64xf32>, tensor<64xf32>) {
  %a = ve.exp %x : tensor<64xf32>
  %b = ve.mul %a, %y : tensor<64xf32>
  func.return %a, %b : tensor<64xf32>, tensor<64xf32>
}
// CHECK-LABEL: func.func @escapes
// CHECK-NOT:   ve.chain
// CHECK:       func.return

// A broadcast changes the stream's shape and a scan needs its own layout: neither joins; the
// add and the subtract both want Fxp's FxpAdd, so the subtract's stream is cut; and the add
// after the reduction finds its home in the Clip cluster (ClipAdd), after IntraSliceReduce.
func.func @homes(%x: tensor<8x4xi32>, %t: tensor<8x4xi4>, %o: tensor<8xi32>) -> tensor<8xi32> {
  %c = ve.const 1 : tensor<8x4xi32>
  %a = ve.add %x, %c : tensor<8x4xi32>
  %r = ve.reduce_sum %a along 1 : tensor<8x4xi32> -> tensor<8xi32>
  %s = ve.add %r, %o : tensor<8xi32>
  %bc = ve.broadcast %s along 1 : tensor<8xi32> -> tensor<8x4xi32>
  %d = ve.sub %bc, %x : tensor<8x4xi32>
  %e = ve.scan add %d, %t along 1 read [1, 2] write [0, 1] : tensor<8x4xi32>, tensor<8x4xi4>
  %f = ve.sub %e, %c : tensor<8x4xi32>
  %g = ve.sub %f, %c : tensor<8x4xi32>
  %h = ve.reduce_sum %g along 1 : tensor<8x4xi32> -> tensor<8xi32>
  func.return %h : tensor<8xi32>
}
// CHECK-LABEL: func.func @homes
// CHECK:       %s = ve.chain
// CHECK-NEXT:    ve.const 1
// CHECK-NEXT:    %a = ve.add
// CHECK-NEXT:    %r = ve.reduce_sum %a along 1
// CHECK-NEXT:    %[[S:.*]] = ve.add %r,
// CHECK-NEXT:    ve.yield %[[S]]
// CHECK-NEXT:  }
// CHECK-NEXT:  %bc = ve.broadcast %s along 1
// CHECK-NEXT:  %d = ve.sub %bc, %x
// CHECK-NEXT:  %e = ve.scan add %d
// CHECK-NEXT:  %f = ve.sub %e,
// CHECK-NEXT:  %h = ve.chain (%{{.*}} = %f)
// CHECK-NEXT:    ve.const 1
// CHECK-NEXT:    %g = ve.sub
// CHECK-NEXT:    %[[H:.*]] = ve.reduce_sum %g along 1
// CHECK-NEXT:    ve.yield %[[H]]
// CHECK-NEXT:  }
// CHECK-NEXT:  func.return %h
