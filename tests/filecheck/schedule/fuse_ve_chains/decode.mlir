// RUN: tcpc-opt %s -p lower-quant,lower-math,fuse-ve-chains | filecheck %s

// A weight decoded for a bf16 contraction, bf16(dequantize(...)), runs as one chain invocation:
// its stored values enter through the Fetch Adapter (f4e2m1 -> f8 by the table, f8 -> f32 by
// fetch_cast: `ve.widen_low`; book, Fetch Adapter) or its 3-bit codes through the Logic stage's
// shift and and (`ve.lookup`), the Float cluster multiplies scale (and signs), the Cast Engine
// rounds to bf16: no f32 copy of the weight reaches SRAM. The scales' own widening stays
// outside (an e8m0 scale's `ve.widen_low` is a shift, not the fetch stage's cast).

func.func @fp4_groups(%w: tensor<2x80x3xf4E2M1FN>, %ws: tensor<2x3x3xbf16>) -> tensor<2x80x3xbf16> {
  %r = lowp.dequantize %w, %ws {block = array<i64: 1, 32, 1>} : tensor<2x80x3xf4E2M1FN>, tensor<2x3x3xbf16> -> tensor<2x80x3xf32>
  %b = tmath.cast %r : tensor<2x80x3xf32> -> tensor<2x80x3xbf16>
  func.return %b : tensor<2x80x3xbf16>
}

// CHECK-LABEL: func.func @fp4_groups
// CHECK:       %scales_expanded_f32 = ve.widen %ws
// CHECK:       %b = ve.chain (%[[W:.*]] = %w, %[[S:.*]] = %scales_expanded) : (tensor<2x80x3xf4E2M1FN>, tensor<2x80x3xf32>) -> tensor<2x80x3xbf16> {
// CHECK-NEXT:    %values_f32 = ve.widen_low %[[W]] : tensor<2x80x3xf4E2M1FN> -> tensor<2x80x3xf32>
// CHECK-NEXT:    %r = ve.mul %values_f32, %[[S]]
// CHECK-NEXT:    %[[B:.*]] = ve.narrow %r : tensor<2x80x3xf32> -> tensor<2x80x3xbf16>
// CHECK-NEXT:    ve.yield %[[B]]

func.func @trellis(%c: tensor<2x40x3xui3>, %ws: tensor<2x2x3xbf16>, %grid: tensor<8xbf16>, %su: tensor<2x40xbf16>, %sv: tensor<2x3xf32>) -> tensor<2x40x3xbf16> {
  %r = lowp.dequantize %c, %ws grid %grid su %su sv %sv {block = array<i64: 1, 32, 1>} : tensor<2x40x3xui3>, tensor<2x2x3xbf16> grid tensor<8xbf16> su tensor<2x40xbf16> sv tensor<2x3xf32> -> tensor<2x40x3xf32>
  %b = tmath.cast %r : tensor<2x40x3xf32> -> tensor<2x40x3xbf16>
  func.return %b : tensor<2x40x3xbf16>
}

// CHECK-LABEL: func.func @trellis
// CHECK:       %b = ve.chain (%[[C:.*]] = %c, %[[G:.*]] = %grid_rows, %[[S:.*]] = %scales_expanded, %[[U:.*]] = %su_spread, %[[V:.*]] = %sv_spread)
// CHECK-NEXT:    %values_f32 = ve.lookup %[[C]] in %[[G]]
// CHECK-NEXT:    %scaled = ve.mul %values_f32, %[[S]]
// CHECK-NEXT:    %scaled_su = ve.mul %scaled, %[[U]]
// CHECK-NEXT:    %r = ve.mul %scaled_su, %[[V]]
// CHECK-NEXT:    %[[B:.*]] = ve.narrow %r
// CHECK-NEXT:    ve.yield %[[B]]

func.func @mxfp4(%w: tensor<2x64x3xf4E2M1FN>, %ws: tensor<2x2x3xf8E8M0FNU>) -> tensor<2x64x3xbf16> {
  %r = lowp.dequantize %w, %ws : tensor<2x64x3xf4E2M1FN>, tensor<2x2x3xf8E8M0FNU> -> tensor<2x64x3xf32>
  %b = tmath.cast %r : tensor<2x64x3xf32> -> tensor<2x64x3xbf16>
  func.return %b : tensor<2x64x3xbf16>
}

// CHECK-LABEL: func.func @mxfp4
// CHECK:       %scales_expanded_f32 = ve.widen_low %ws : tensor<2x2x3xf8E8M0FNU> -> tensor<2x2x3xf32>
// CHECK:       %b = ve.chain (%[[W:.*]] = %w, %[[S:.*]] = %scales_expanded)
// CHECK-NEXT:    %values_f32 = ve.widen_low %[[W]] : tensor<2x64x3xf4E2M1FN> -> tensor<2x64x3xf32>
// CHECK-NEXT:    %r = ve.mul %values_f32, %[[S]]
// CHECK-NEXT:    %[[B:.*]] = ve.narrow %r
// CHECK-NEXT:    ve.yield %[[B]]
