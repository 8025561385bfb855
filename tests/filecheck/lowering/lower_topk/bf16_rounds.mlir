// RUN: tcpc-opt %s -p 'lower-topk{strategy=rounds}' | filecheck %s

// bf16, K rounds of max: packed keys are distinct, so each round's maximum is one element;
// it is marked with the round number and masked to INT_MIN. No [T, E, E] tensor.

func.func @router(%scores: tensor<16x8xbf16>) -> (tensor<16x3xbf16>, tensor<16x3xi32>) {
  %top_p, %top_e = moe.topk %scores {k = 3 : i64} : tensor<16x8xbf16> -> tensor<16x3xbf16>, tensor<16x3xi32>
  func.return %top_p, %top_e : tensor<16x3xbf16>, tensor<16x3xi32>
}

// CHECK-LABEL: func.func @router
// CHECK-NOT:   x8x8x
// CHECK:       %packed = ve.or %bits, %field : tensor<16x8xi32>
// CHECK:       %key = ve.xor
// CHECK-NEXT:  %[[NOT_CHOSEN:.*]] = ve.const 3 : tensor<16x8xi32>
// CHECK-NEXT:  %[[M0:.*]] = ve.reduce_max %key along 1 : tensor<16x8xi32> -> tensor<16xi32>
// CHECK-NEXT:  %max0 = ve.broadcast %[[M0]] along 1 : tensor<16xi32> -> tensor<16x8xi32>
// CHECK-NEXT:  %hit0 = ve.tag eq %key, %max0 : tensor<16x8xi32> -> tensor<16x8xi4>
// CHECK-NEXT:  %rank = ve.select %hit0 in [1], %{{.*}}, %[[NOT_CHOSEN]]
// CHECK-NEXT:  %live = ve.select %hit0 in [1], %[[MIN:.*]], %key
// CHECK-NEXT:  %[[M1:.*]] = ve.reduce_max %live along 1
// CHECK-NEXT:  %max1 = ve.broadcast %[[M1]] along 1
// CHECK-NEXT:  %hit1 = ve.tag eq %live, %max1
// CHECK:       %rank_1 = ve.select %hit1 in [1], %{{.*}}, %rank
// CHECK-NEXT:  %live_1 = ve.select %hit1 in [1], %[[MIN]], %live
// CHECK:       %hit2 = ve.tag eq %live_1, %max2
// CHECK:       %rank_2 = ve.select %hit2 in [1], %{{.*}}, %rank_1
// CHECK-NOT:   %live_2
// CHECK-NEXT:  %chosen = ve.tag lt %rank_2, %[[NOT_CHOSEN]]
// CHECK-NEXT:  %top_packed = ve.filter %packed, %chosen keep [1] along 1 pad 0 : tensor<16x8xi32>, tensor<16x8xi4> -> tensor<16x3xi32>
// CHECK:       %place = ve.tag eq %{{.*}}, %{{.*}} : tensor<16x3x3xi32> -> tensor<16x3x3xi4>
// CHECK:       %top_p = ve.narrow %{{.*}} truncate : tensor<16x3xf32> -> tensor<16x3xbf16>
