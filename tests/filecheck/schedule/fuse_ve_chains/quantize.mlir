// RUN: tcpc-opt %s -p lower-quant,fuse-ve-chains | filecheck %s

// A lowered quantize runs as two chain invocations and one small division: the amax stream
// (the fetch cast of bf16 x, |x| by the Logic cluster, the group's reduce_max, the Clip
// cluster's max with eps) and the division stream (the fetch cast again, FpDiv by the
// broadcast scale, the Cast Engine's f32 -> f8e4m3: book, Cast Engine). The scale's division
// (FpDiv) would come after Clip in the first chain, an earlier stage, so it runs alone.

func.func @quantize(%x: tensor<2x3x8xbf16>) -> (tensor<2x3x8xf8E4M3FN>, tensor<2x3x2xf32>) {
  %xq, %xs = lowp.quantize %x {group = 4 : i64} : tensor<2x3x8xbf16> -> tensor<2x3x8xf8E4M3FN>, tensor<2x3x2xf32>
  func.return %xq, %xs : tensor<2x3x8xf8E4M3FN>, tensor<2x3x2xf32>
}

// CHECK-LABEL: func.func @quantize
// CHECK:       %amax_floor = ve.chain (%x_groups_1 = %x_groups) : (tensor<2x3x2x4xbf16>) -> tensor<2x3x2xf32> {
// CHECK:         %x_f32 = ve.widen %x_groups_1
// CHECK-NEXT:    ve.bitcast %x_f32
// CHECK-NEXT:    ve.and
// CHECK-NEXT:    %x_abs = ve.bitcast
// CHECK-NEXT:    %amax = ve.reduce_max %x_abs along 3
// CHECK-NEXT:    %[[FLOOR:.*]] = ve.max %amax
// CHECK-NEXT:    ve.yield %[[FLOOR]]
// CHECK:       %xs = ve.div %amax_floor
// CHECK:       %values_groups = ve.chain (%[[XG:.*]] = %x_groups, %{{.*}} = %{{.*}}) : (tensor<2x3x2x4xbf16>, tensor<2x3x2x4xf32>) -> tensor<2x3x2x4xf8E4M3FN> {
// CHECK-NEXT:    %x_f32_again = ve.widen %[[XG]]
// CHECK-NEXT:    %x_scaled = ve.div %x_f32_again
// CHECK-NEXT:    %[[V:.*]] = ve.narrow_low %x_scaled : tensor<2x3x2x4xf32> -> tensor<2x3x2x4xf8E4M3FN>
// CHECK-NEXT:    ve.yield %[[V]]
// CHECK:       %xq = tcp.view %values_groups
// CHECK:       func.return %xq, %xs
