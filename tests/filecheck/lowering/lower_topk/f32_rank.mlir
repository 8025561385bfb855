// RUN: tcpc-opt %s -p lower-topk | filecheck %s
// RUN: tcpc-opt %s -p lower-topk --print-op-generic | tcpc-opt | filecheck %s

// f32 scores, all-pairs ranking: a sortable 32-bit key (no rounding to bf16) compared
// lexicographically with the index, since equal keys are possible.

func.func @router(%probs: tensor<16x8xf32>) -> (tensor<16x2xf32>, tensor<16x2xi32>) {
  %top_p, %top_e = moe.topk %probs {k = 2 : i64} : tensor<16x8xf32> -> tensor<16x2xf32>, tensor<16x2xi32>
  func.return %top_p, %top_e : tensor<16x2xf32>, tensor<16x2xi32>
}

// CHECK-LABEL: func.func @router
// CHECK-NOT:   moe.topk
// CHECK-NOT:   ve.widen
// CHECK:       %index = ve.iota along 1 : tensor<16x8xi32>
// CHECK-NEXT:  %bits = ve.bitcast %probs : tensor<16x8xf32> -> tensor<16x8xi32>
// CHECK:       %is_nan = ve.tag gt
// CHECK:       %is_neg_zero = ve.tag eq %bits
// CHECK:       %[[NAN:.*]] = ve.const 0xff800001 : tensor<16x8xi32>
// CHECK-NEXT:  %canonical = ve.select %is_nan in [1], %[[NAN]], %{{.*}}
// CHECK:       %[[SIGN:.*]] = ve.shr_s %canonical, %{{.*}} : tensor<16x8xi32>
// CHECK-NEXT:  %[[FLIP:.*]] = ve.and %[[SIGN]], %{{.*}} : tensor<16x8xi32>
// CHECK-NEXT:  %key = ve.xor %canonical, %[[FLIP]] : tensor<16x8xi32>
// CHECK-NEXT:  %key_i = ve.broadcast %key along 2 : tensor<16x8xi32> -> tensor<16x8x8xi32>
// CHECK-NEXT:  %key_j = ve.broadcast %key along 1 : tensor<16x8xi32> -> tensor<16x8x8xi32>
// CHECK-NEXT:  %beats = ve.tag gt %key_j, %key_i : tensor<16x8x8xi32> -> tensor<16x8x8xi4>
// Ties go to the lower index: j wins a tie against i when j < i.
// CHECK-NEXT:  %[[J:.*]] = ve.iota along 2 : tensor<16x8x8xi32>
// CHECK-NEXT:  %[[I:.*]] = ve.iota along 1 : tensor<16x8x8xi32>
// CHECK-NEXT:  %earlier = ve.tag lt %[[J]], %[[I]] : tensor<16x8x8xi32> -> tensor<16x8x8xi4>
// CHECK-NEXT:  %ties = ve.tag eq %key_j, %key_i : tensor<16x8x8xi32> -> tensor<16x8x8xi4>
// CHECK:       %[[B:.*]] = ve.select %beats in [1]
// CHECK-NEXT:  %rank = ve.reduce_sum %[[B]] along 2 : tensor<16x8x8xi32> -> tensor<16x8xi32>
// CHECK:       %chosen = ve.tag lt %rank
// Values travel as raw bits (so -0.0 and NaN payloads survive), indices as their own stream.
// CHECK-NEXT:  %top_values = ve.filter %bits, %chosen keep [1] along 1 pad 0 : tensor<16x8xi32>, tensor<16x8xi4> -> tensor<16x2xi32>
// CHECK-NEXT:  %top_index = ve.filter %index, %chosen keep [1] along 1 pad 0 : tensor<16x8xi32>, tensor<16x8xi4> -> tensor<16x2xi32>
// CHECK-NEXT:  %top_rank = ve.filter %rank, %chosen keep [1] along 1 pad 0 : tensor<16x8xi32>, tensor<16x8xi4> -> tensor<16x2xi32>
// CHECK:       %place = ve.tag eq %{{.*}}, %{{.*}} : tensor<16x2x2xi32> -> tensor<16x2x2xi4>
// CHECK:       %[[V:.*]] = ve.reduce_sum %{{.*}} along 1 : tensor<16x2x2xi32> -> tensor<16x2xi32>
// CHECK:       %top_e = ve.reduce_sum %{{.*}} along 1 : tensor<16x2x2xi32> -> tensor<16x2xi32>
// CHECK-NEXT:  %top_p = ve.bitcast %[[V]] : tensor<16x2xi32> -> tensor<16x2xf32>
// CHECK-NEXT:  func.return %top_p, %top_e : tensor<16x2xf32>, tensor<16x2xi32>
