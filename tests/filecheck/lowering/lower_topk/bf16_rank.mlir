// RUN: tcpc-opt %s -p lower-topk | filecheck %s
// RUN: tcpc-opt %s -p 'lower-topk{strategy=rank}' | filecheck %s
// RUN: tcpc-opt %s -p lower-topk | tcpc-opt | filecheck %s
// RUN: tcpc-opt %s -p lower-topk --print-op-generic | tcpc-opt | filecheck %s

// bf16 scores, all-pairs ranking: pack, compare trick, [T, E, E] compare, reduce to ranks,
// filter to [T, K], place by rank (score order), unpack.

func.func @router(%scores: tensor<16x8xbf16>) -> (tensor<16x2xbf16>, tensor<16x2xi32>) {
  %top_p, %top_e = moe.topk %scores {k = 2 : i64} : tensor<16x8xbf16> -> tensor<16x2xbf16>, tensor<16x2xi32>
  func.return %top_p, %top_e : tensor<16x2xbf16>, tensor<16x2xi32>
}

// CHECK-LABEL: func.func @router
// CHECK-NOT:   moe.topk
// CHECK:       %index = ve.iota along 1 : tensor<16x8xi32>
// CHECK-NEXT:  %[[W:.*]] = ve.widen %scores : tensor<16x8xbf16> -> tensor<16x8xf32>
// CHECK-NEXT:  %bits = ve.bitcast %[[W]] : tensor<16x8xf32> -> tensor<16x8xi32>
// CHECK-NEXT:  %[[FF:.*]] = ve.const 65535 : tensor<16x8xi32>
// CHECK-NEXT:  %field = ve.xor %index, %[[FF]] : tensor<16x8xi32>
// CHECK-NEXT:  %packed = ve.or %bits, %field : tensor<16x8xi32>
// Canonicalise before keying: NaN below -inf, -0.0 as +0.0.
// CHECK:       %is_nan = ve.tag gt %{{.*}}, %{{.*}} : tensor<16x8xi32> -> tensor<16x8xi4>
// CHECK:       %[[NZ:.*]] = ve.const 0x80000000 : tensor<16x8xi32>
// CHECK-NEXT:  %is_neg_zero = ve.tag eq %bits, %[[NZ]]
// CHECK:       %[[NAN:.*]] = ve.const 0xff810000 : tensor<16x8xi32>
// CHECK-NEXT:  %canonical = ve.select %is_nan in [1], %[[NAN]], %{{.*}} : tensor<16x8xi4>, tensor<16x8xi32>
// CHECK-NEXT:  %[[CP:.*]] = ve.or %canonical, %field : tensor<16x8xi32>
// The comparison trick: XOR 0x7fff0000 where the packed value is negative.
// CHECK:       %[[SIGN:.*]] = ve.shr_s %[[CP]], %{{.*}} : tensor<16x8xi32>
// CHECK-NEXT:  %[[MAG:.*]] = ve.const 0x7fff0000 : tensor<16x8xi32>
// CHECK-NEXT:  %[[FLIP:.*]] = ve.and %[[SIGN]], %[[MAG]] : tensor<16x8xi32>
// CHECK-NEXT:  %key = ve.xor %[[CP]], %[[FLIP]] : tensor<16x8xi32>
// All pairs: distinct keys, one compare per pair.
// CHECK-NEXT:  %key_i = ve.broadcast %key along 2 : tensor<16x8xi32> -> tensor<16x8x8xi32>
// CHECK-NEXT:  %key_j = ve.broadcast %key along 1 : tensor<16x8xi32> -> tensor<16x8x8xi32>
// CHECK-NEXT:  %beats = ve.tag gt %key_j, %key_i : tensor<16x8x8xi32> -> tensor<16x8x8xi4>
// CHECK-NOT:   ve.tag eq %key_j
// CHECK:       %[[ONE:.*]] = ve.select %beats in [1], %{{.*}}, %{{.*}} : tensor<16x8x8xi4>, tensor<16x8x8xi32>
// CHECK-NEXT:  %rank = ve.reduce_sum %[[ONE]] along 2 : tensor<16x8x8xi32> -> tensor<16x8xi32>
// CHECK-NEXT:  %[[K:.*]] = ve.const 2 : tensor<16x8xi32>
// CHECK-NEXT:  %chosen = ve.tag lt %rank, %[[K]] : tensor<16x8xi32> -> tensor<16x8xi4>
// CHECK-NEXT:  %top_packed = ve.filter %packed, %chosen keep [1] along 1 pad 0 : tensor<16x8xi32>, tensor<16x8xi4> -> tensor<16x2xi32>
// Score order: place each kept element at its rank.
// CHECK-NEXT:  %top_rank = ve.filter %rank, %chosen keep [1] along 1 pad 0 : tensor<16x8xi32>, tensor<16x8xi4> -> tensor<16x2xi32>
// CHECK:       %place = ve.tag eq %{{.*}}, %{{.*}} : tensor<16x2x2xi32> -> tensor<16x2x2xi4>
// CHECK:       %ordered = ve.reduce_sum %{{.*}} along 1 : tensor<16x2x2xi32> -> tensor<16x2xi32>
// Unpack: index = 0xffff - field, value = the upper 16 bits.
// CHECK:       %top_e = ve.xor %{{.*}}, %{{.*}} : tensor<16x2xi32>
// CHECK-NEXT:  %[[V:.*]] = ve.bitcast %ordered : tensor<16x2xi32> -> tensor<16x2xf32>
// CHECK-NEXT:  %top_p = ve.narrow %[[V]] truncate : tensor<16x2xf32> -> tensor<16x2xbf16>
// CHECK-NEXT:  func.return %top_p, %top_e : tensor<16x2xbf16>, tensor<16x2xi32>
