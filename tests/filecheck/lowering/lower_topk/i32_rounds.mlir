// RUN: tcpc-opt %s -p 'lower-topk{strategy=rounds}' | filecheck %s

// i32, K rounds: INT_MIN is a real score as well as the mask, so taken positions also leave
// the candidate positions (`available`).

func.func @pick(%x: tensor<5xi32>) -> (tensor<2xi32>, tensor<2xi32>) {
  %v, %i = moe.topk %x {k = 2 : i64} : tensor<5xi32> -> tensor<2xi32>, tensor<2xi32>
  func.return %v, %i : tensor<2xi32>, tensor<2xi32>
}

// CHECK-LABEL: func.func @pick
// CHECK:       %[[M0:.*]] = ve.reduce_max %x along 0 : tensor<5xi32> -> tensor<i32>
// CHECK-NEXT:  %max0 = ve.broadcast %[[M0]] along 0 : tensor<i32> -> tensor<5xi32>
// CHECK-NEXT:  %ties0 = ve.tag eq %x, %max0
// CHECK:       %hit0 = ve.tag eq %index
// CHECK:       %live = ve.select %hit0 in [1], %{{.*}}, %x : tensor<5xi4>, tensor<5xi32>
// CHECK-NEXT:  %available = ve.select %hit0 in [1], %{{.*}}, %index : tensor<5xi4>, tensor<5xi32>
// CHECK:       %ties1 = ve.tag eq %live, %max1
// CHECK-NEXT:  %{{.*}} = ve.select %ties1 in [1], %available, %{{.*}}
// CHECK:       %top_values = ve.filter %x, %chosen keep [1] along 0 pad 0 : tensor<5xi32>, tensor<5xi4> -> tensor<2xi32>
// CHECK:       %place = ve.tag eq %{{.*}}, %{{.*}} : tensor<2x2xi32> -> tensor<2x2xi4>
// CHECK:       func.return %v, %i : tensor<2xi32>, tensor<2xi32>
