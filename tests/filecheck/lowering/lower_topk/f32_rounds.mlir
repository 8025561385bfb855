// RUN: tcpc-opt %s -p 'lower-topk{strategy=rounds}' | filecheck %s

// f32, K rounds: equal keys are possible, so each round takes the lowest index among the
// maxima (a reduce-min over the positions). Index order: no placement step.

func.func @router(%probs: tensor<16x8xf32>) -> (tensor<16x2xf32>, tensor<16x2xi32>) {
  %top_p, %top_e = moe.topk %probs {k = 2 : i64, order = "index"} : tensor<16x8xf32> -> tensor<16x2xf32>, tensor<16x2xi32>
  func.return %top_p, %top_e : tensor<16x2xf32>, tensor<16x2xi32>
}

// CHECK-LABEL: func.func @router
// CHECK:       %key = ve.xor
// CHECK:       %max0 = ve.broadcast %{{.*}} along 1 : tensor<16xi32> -> tensor<16x8xi32>
// CHECK-NEXT:  %ties0 = ve.tag eq %key, %max0 : tensor<16x8xi32> -> tensor<16x8xi4>
// CHECK-NEXT:  %[[E:.*]] = ve.const 8 : tensor<16x8xi32>
// CHECK-NEXT:  %[[CAND:.*]] = ve.select %ties0 in [1], %index, %[[E]]
// CHECK-NEXT:  %[[FIRST:.*]] = ve.reduce_min %[[CAND]] along 1 : tensor<16x8xi32> -> tensor<16xi32>
// CHECK-NEXT:  %[[FB:.*]] = ve.broadcast %[[FIRST]] along 1
// CHECK-NEXT:  %hit0 = ve.tag eq %index, %[[FB]]
// CHECK:       %ties1 = ve.tag eq %live, %max1
// CHECK:       %hit1 = ve.tag eq %index
// CHECK:       %chosen = ve.tag lt
// CHECK-NEXT:  %top_values = ve.filter %bits, %chosen keep [1] along 1 pad 0 : tensor<16x8xi32>, tensor<16x8xi4> -> tensor<16x2xi32>
// CHECK-NEXT:  %top_e = ve.filter %index, %chosen keep [1] along 1 pad 0 : tensor<16x8xi32>, tensor<16x8xi4> -> tensor<16x2xi32>
// CHECK-NEXT:  %top_p = ve.bitcast %top_values : tensor<16x2xi32> -> tensor<16x2xf32>
// CHECK-NEXT:  func.return %top_p, %top_e
