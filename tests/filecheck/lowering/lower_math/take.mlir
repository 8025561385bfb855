// RUN: tcpc-opt %s -p lower-math | filecheck %s

// take along the last axis, branchless: negative indices + N, a one-hot tag of [..., M, N]
// against an iota, then the value's 32 bits where it hits (INT_MIN elsewhere) and an integer
// reduce_max: -0.0 (bits INT_MIN), NaN payloads and bf16 bits come back unchanged.

func.func @chosen_scores(%s: tensor<16x8xf32>, %top_e: tensor<16x2xi32>) -> tensor<16x2xf32> {
  %t = tmath.take %s, %top_e : (tensor<16x8xf32>, tensor<16x2xi32>) -> tensor<16x2xf32>
  func.return %t : tensor<16x2xf32>
}

// CHECK-LABEL: func.func @chosen_scores
// CHECK-NEXT:  %[[N:.*]] = ve.const 8 : tensor<16x2xi32>
// CHECK-NEXT:  %[[W:.*]] = ve.add %top_e, %[[N]] : tensor<16x2xi32>
// CHECK-NEXT:  %[[Z:.*]] = ve.const 0 : tensor<16x2xi32>
// CHECK-NEXT:  %from_end = ve.tag lt %top_e, %[[Z]] : tensor<16x2xi32> -> tensor<16x2xi4>
// CHECK-NEXT:  %index = ve.select %from_end in [1], %[[W]], %top_e : tensor<16x2xi4>, tensor<16x2xi32>
// CHECK-NEXT:  %bits = ve.bitcast %s : tensor<16x8xf32> -> tensor<16x8xi32>
// CHECK-NEXT:  %[[I:.*]] = ve.broadcast %index along 2 : tensor<16x2xi32> -> tensor<16x2x8xi32>
// CHECK-NEXT:  %position = ve.iota along 2 : tensor<16x2x8xi32>
// CHECK-NEXT:  %hit = ve.tag eq %[[I]], %position : tensor<16x2x8xi32> -> tensor<16x2x8xi4>
// CHECK-NEXT:  %[[X:.*]] = ve.broadcast %bits along 1 : tensor<16x8xi32> -> tensor<16x2x8xi32>
// CHECK-NEXT:  %[[FILL:.*]] = ve.const 0x80000000 : tensor<16x2x8xi32>
// CHECK-NEXT:  %[[P:.*]] = ve.select %hit in [1], %[[X]], %[[FILL]] : tensor<16x2x8xi4>, tensor<16x2x8xi32>
// CHECK-NEXT:  %[[R:.*]] = ve.reduce_max %[[P]] along 2 : tensor<16x2x8xi32> -> tensor<16x2xi32>
// CHECK-NEXT:  %t = ve.bitcast %[[R]] : tensor<16x2xi32> -> tensor<16x2xf32>
// CHECK-NEXT:  func.return %t : tensor<16x2xf32>

func.func @bf16_bits(%s: tensor<8xbf16>, %i: tensor<3xi32>) -> tensor<3xbf16> {
  %t = tmath.take %s, %i : (tensor<8xbf16>, tensor<3xi32>) -> tensor<3xbf16>
  func.return %t : tensor<3xbf16>
}

// bf16 leaves by narrow truncate, the exact inverse of widen (no rounding of NaN payloads).
// CHECK-LABEL: func.func @bf16_bits
// CHECK:       %[[S:.*]] = ve.widen %s : tensor<8xbf16> -> tensor<8xf32>
// CHECK-NEXT:  %bits = ve.bitcast %[[S]] : tensor<8xf32> -> tensor<8xi32>
// CHECK:       %[[R:.*]] = ve.reduce_max %{{.*}} along 1 : tensor<3x8xi32> -> tensor<3xi32>
// CHECK-NEXT:  %[[F:.*]] = ve.bitcast %[[R]] : tensor<3xi32> -> tensor<3xf32>
// CHECK-NEXT:  %t = ve.narrow %[[F]] truncate : tensor<3xf32> -> tensor<3xbf16>
