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

// FP4 with a bf16 scale per group of 32 along K, K = 80 not a multiple of 32 (the seed's
// scales [E, ceil(K / g), N]): bf16 scales widen; along the ragged axis the scales are
// repeated and cut to the values' length (ve.repeat), along the others as above.

func.func @ragged(%w: tensor<2x80x3xf4E2M1FN>, %ws: tensor<2x3x3xbf16>) -> tensor<2x80x3xf32> {
  %r = lowp.dequantize %w, %ws {block = array<i64: 1, 32, 1>} : tensor<2x80x3xf4E2M1FN>, tensor<2x3x3xbf16> -> tensor<2x80x3xf32>
  func.return %r : tensor<2x80x3xf32>
}

// CHECK-LABEL: func.func @ragged
// CHECK:       %values_f32 = ve.widen_low %w : tensor<2x80x3xf4E2M1FN> -> tensor<2x80x3xf32>
// CHECK-NEXT:  %scales_expanded_f32 = ve.widen %ws : tensor<2x3x3xbf16> -> tensor<2x3x3xf32>
// CHECK-NEXT:  %scales_expanded = ve.repeat %scales_expanded_f32 along 1 times 32 : tensor<2x3x3xf32> -> tensor<2x80x3xf32>
// CHECK-NEXT:  %r = ve.mul %values_f32, %scales_expanded : tensor<2x80x3xf32>

// The 3-bit trellis format: u3 codes looked up in the grid (broadcast to a table per row, a
// free view), times the scale, times su[k] (broadcast over N), times sv[n] (broadcast over K).

func.func @trellis(%c: tensor<2x40x3xui3>, %ws: tensor<2x2x3xbf16>, %grid: tensor<8xbf16>, %su: tensor<2x40xbf16>, %sv: tensor<2x3xf32>) -> tensor<2x40x3xf32> {
  %r = lowp.dequantize %c, %ws grid %grid su %su sv %sv {block = array<i64: 1, 32, 1>} : tensor<2x40x3xui3>, tensor<2x2x3xbf16> grid tensor<8xbf16> su tensor<2x40xbf16> sv tensor<2x3xf32> -> tensor<2x40x3xf32>
  func.return %r : tensor<2x40x3xf32>
}

// CHECK-LABEL: func.func @trellis
// CHECK:       %grid_f32 = ve.widen %grid : tensor<8xbf16> -> tensor<8xf32>
// CHECK-NEXT:  %grid_rows = ve.broadcast %grid_f32 along 0 : tensor<8xf32> -> tensor<2x8xf32>
// CHECK-NEXT:  %values_f32 = ve.lookup %c in %grid_rows : tensor<2x40x3xui3>, tensor<2x8xf32> -> tensor<2x40x3xf32>
// CHECK-NEXT:  %scales_expanded_f32 = ve.widen %ws : tensor<2x2x3xbf16> -> tensor<2x2x3xf32>
// CHECK-NEXT:  %scales_expanded = ve.repeat %scales_expanded_f32 along 1 times 32 : tensor<2x2x3xf32> -> tensor<2x40x3xf32>
// CHECK-NEXT:  %scaled = ve.mul %values_f32, %scales_expanded : tensor<2x40x3xf32>
// CHECK-NEXT:  %su_f32 = ve.widen %su : tensor<2x40xbf16> -> tensor<2x40xf32>
// CHECK-NEXT:  %su_spread = ve.broadcast %su_f32 along 2 : tensor<2x40xf32> -> tensor<2x40x3xf32>
// CHECK-NEXT:  %scaled_su = ve.mul %scaled, %su_spread : tensor<2x40x3xf32>
// CHECK-NEXT:  %sv_spread = ve.broadcast %sv along 1 : tensor<2x3xf32> -> tensor<2x40x3xf32>
// CHECK-NEXT:  %r = ve.mul %scaled_su, %sv_spread : tensor<2x40x3xf32>
