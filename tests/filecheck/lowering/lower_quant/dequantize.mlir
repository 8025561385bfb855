// RUN: tcpc-opt %s -p lower-quant | filecheck %s
// RUN: tcpc-opt %s -p lower-quant --print-op-generic | tcpc-opt | filecheck %s

// dequantize: values and e8m0 scales enter f32 lanes (widen_low, exact); each scale is repeated
// over its block, axis by axis (a broadcast along a new axis and a view: both free), and one
// multiply gives f32. MXFP4's layout: one scale per 32 values along the reduction axis.

func.func @mxfp4(%w: tensor<2x64x3xf4E2M1FN>, %ws: tensor<2x2x3xf8E8M0FNU>) -> tensor<2x64x3xf32> {
  %r = lowp.dequantize %w, %ws : tensor<2x64x3xf4E2M1FN>, tensor<2x2x3xf8E8M0FNU> -> tensor<2x64x3xf32>
  func.return %r : tensor<2x64x3xf32>
}

// CHECK-LABEL: func.func @mxfp4
// CHECK:       %values_f32 = ve.widen_low %w : tensor<2x64x3xf4E2M1FN> -> tensor<2x64x3xf32>
// CHECK-NEXT:  %scales_expanded_f32 = ve.widen_low %ws : tensor<2x2x3xf8E8M0FNU> -> tensor<2x2x3xf32>
// CHECK-NEXT:  %[[T:.*]] = ve.broadcast %scales_expanded_f32 along 2 : tensor<2x2x3xf32> -> tensor<2x2x32x3xf32>
// CHECK-NEXT:  %scales_expanded = tcp.view %[[T]] : tensor<2x2x32x3xf32> -> tensor<2x64x3xf32>
// CHECK-NEXT:  %r = ve.mul %values_f32, %scales_expanded : tensor<2x64x3xf32>

// DeepSeek-V3's layout: one f32 scale per 128 x 128 block (here 4 x 2): two repeats.

func.func @blocks(%w: tensor<8x4xf8E4M3FN>, %ws: tensor<2x2xf32>) -> tensor<8x4xf32> {
  %r = lowp.dequantize %w, %ws : tensor<8x4xf8E4M3FN>, tensor<2x2xf32> -> tensor<8x4xf32>
  func.return %r : tensor<8x4xf32>
}

// CHECK-LABEL: func.func @blocks
// CHECK:       %values_f32 = ve.widen_low %w : tensor<8x4xf8E4M3FN> -> tensor<8x4xf32>
// CHECK-NEXT:  %[[A:.*]] = ve.broadcast %ws along 1 : tensor<2x2xf32> -> tensor<2x4x2xf32>
// CHECK-NEXT:  %[[B:.*]] = tcp.view %[[A]] : tensor<2x4x2xf32> -> tensor<8x2xf32>
// CHECK-NEXT:  %[[C:.*]] = ve.broadcast %[[B]] along 2 : tensor<8x2xf32> -> tensor<8x2x2xf32>
// CHECK-NEXT:  %scales_expanded = tcp.view %[[C]] : tensor<8x2x2xf32> -> tensor<8x4xf32>
// CHECK-NEXT:  %r = ve.mul %values_f32, %scales_expanded : tensor<8x4xf32>
