// RUN: tcpc-opt %s -p fuse-ve-chains | filecheck %s

// The Tag stage opens the chain: it compares the stream against a constant, and the select
// (Logic) and filter after it read its tags; the tags never leave the chain.
func.func @canonical(%bits: tensor<16x8xi32>) -> tensor<16x8xi32> {
  %m = ve.const 0x80000000 : tensor<16x8xi32>
  %z = ve.const 0 : tensor<16x8xi32>
  %t = ve.tag eq %bits, %m : tensor<16x8xi32> -> tensor<16x8xi4>
  %r = ve.select %t in [1], %z, %bits : tensor<16x8xi4>, tensor<16x8xi32>
  func.return %r : tensor<16x8xi32>
}
// CHECK-LABEL: func.func @canonical
// CHECK-NEXT:  %r = ve.chain (%[[B:.*]] = %bits) : (tensor<16x8xi32>) -> tensor<16x8xi32> {
// CHECK-NEXT:    %[[M:.*]] = ve.const 0x80000000
// CHECK-NEXT:    %[[Z:.*]] = ve.const 0
// CHECK-NEXT:    %t = ve.tag eq %[[B]], %[[M]]
// CHECK-NEXT:    %[[R:.*]] = ve.select %t in [1], %[[Z]], %[[B]]
// CHECK-NEXT:    ve.yield %[[R]]
// CHECK-NEXT:  }

func.func @compact(%grid: tensor<32xi32>) -> tensor<14xi32> {
  %z = ve.const 0 : tensor<32xi32>
  %t = ve.tag ge %grid, %z : tensor<32xi32> -> tensor<32xi4>
  %ids = ve.filter %grid, %t keep [1] along 0 pad -1 : tensor<32xi32>, tensor<32xi4> -> tensor<14xi32>
  func.return %ids : tensor<14xi32>
}
// CHECK-LABEL: func.func @compact
// CHECK-NEXT:  %ids = ve.chain (%[[G:.*]] = %grid)
// CHECK:         %t = ve.tag ge %[[G]]
// CHECK-NEXT:    ve.filter %[[G]], %t keep [1] along 0 pad -1

// A tag compared against another stream (not a constant) is no Tag stage, and tags read by
// an op outside keep their tag op outside: neither fuses.
func.func @no_tag_stage(%a: tensor<8xi32>, %b: tensor<8xi32>) -> (tensor<8xi32>, tensor<8xi4>) {
  %t = ve.tag gt %a, %b : tensor<8xi32> -> tensor<8xi4>
  %r = ve.select %t in [1], %a, %b : tensor<8xi4>, tensor<8xi32>
  %z = ve.const 0 : tensor<8xi32>
  %u = ve.tag gt %a, %z : tensor<8xi32> -> tensor<8xi4>
  %s = ve.select %u in [1], %r, %a : tensor<8xi4>, tensor<8xi32>
  func.return %s, %u : tensor<8xi32>, tensor<8xi4>
}
// CHECK-LABEL: func.func @no_tag_stage
// CHECK-NOT:   ve.chain
// CHECK:       func.return
