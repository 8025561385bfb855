// RUN: tcpc-opt %s --split-input-file --verify-diagnostics --parsing-diagnostics | filecheck %s

// The lowp verifier's cases: each split case is rejected with the message checked after it.

func.func @quantize_int(%x: tensor<2x8xi32>) {
  %q, %s = lowp.quantize %x {group = 4 : i64} : tensor<2x8xi32> -> tensor<2x8xf8E4M3FN>, tensor<2x2xf32>
  func.return
}

// CHECK: quantize takes bf16 or f32, got i32[2, 8]

// -----

func.func @quantize_group(%x: tensor<2x8xbf16>) {
  %q, %s = lowp.quantize %x {group = 3 : i64} : tensor<2x8xbf16> -> tensor<2x8xf8E4M3FN>, tensor<2x2xf32>
  func.return
}

// CHECK: group 3 does not divide the last axis of bf16[2, 8]

// -----

func.func @quantize_values(%x: tensor<2x8xbf16>) {
  %q, %s = lowp.quantize %x {group = 4 : i64} : tensor<2x8xbf16> -> tensor<2x8xbf16>, tensor<2x2xf32>
  func.return
}

// CHECK: values must be a low-precision tensor of the input's shape

// -----

func.func @quantize_scales(%x: tensor<2x8xbf16>) {
  %q, %s = lowp.quantize %x {group = 4 : i64} : tensor<2x8xbf16> -> tensor<2x8xf8E4M3FN>, tensor<2x4xf32>
  func.return
}

// CHECK: scales must be f32 [2, 2]

// -----

func.func @dequantize_values(%v: tensor<8x4xbf16>, %s: tensor<2x2xf32>) {
  %r = lowp.dequantize %v, %s : tensor<8x4xbf16>, tensor<2x2xf32> -> tensor<8x4xf32>
  func.return
}

// CHECK: dequantize values must be f8e4m3, f8e5m2, f4e2m1 or u3, got bf16[8, 4]

// -----

func.func @dequantize_scales(%v: tensor<8x4xf8E4M3FN>, %s: tensor<2x2xi32>) {
  %r = lowp.dequantize %v, %s : tensor<8x4xf8E4M3FN>, tensor<2x2xi32> -> tensor<8x4xf32>
  func.return
}

// CHECK: dequantize scales must be f32, bf16 or e8m0, got i32[2, 2]

// -----

func.func @dequantize_ragged(%v: tensor<2x80x3xf4E2M1FN>, %s: tensor<2x2x3xbf16>) {
  %r = lowp.dequantize %v, %s {block = array<i64: 1, 32, 1>} : tensor<2x80x3xf4E2M1FN>, tensor<2x2x3xbf16> -> tensor<2x80x3xf32>
  func.return
}

// CHECK: scales bf16[2, 2, 3] are not [2, 3, 3]: f4e2m1[2, 80, 3] in blocks of [1, 32, 1]

// -----

func.func @dequantize_no_grid(%c: tensor<2x16x3xui3>, %s: tensor<2x1x3xf32>) {
  %r = lowp.dequantize %c, %s : tensor<2x16x3xui3>, tensor<2x1x3xf32> -> tensor<2x16x3xf32>
  func.return
}

// CHECK: u3 codes need their grid: u3[2, 16, 3]

// -----

func.func @dequantize_grid_size(%c: tensor<2x16x3xui3>, %s: tensor<2x1x3xf32>, %g: tensor<4xf32>) {
  %r = lowp.dequantize %c, %s grid %g : tensor<2x16x3xui3>, tensor<2x1x3xf32> grid tensor<4xf32> -> tensor<2x16x3xf32>
  func.return
}

// CHECK: grid must be bf16 or f32 [8], got f32[4]

// -----

func.func @dequantize_signs(%c: tensor<2x16x3xui3>, %s: tensor<2x1x3xf32>, %g: tensor<8xf32>, %su: tensor<2x3xf32>) {
  %r = lowp.dequantize %c, %s grid %g su %su : tensor<2x16x3xui3>, tensor<2x1x3xf32> grid tensor<8xf32> su tensor<2x3xf32> -> tensor<2x16x3xf32>
  func.return
}

// CHECK: su must be bf16 or f32 [2, 16], got f32[2, 3]

// -----

func.func @dequantize_blocks(%v: tensor<8x4xf8E4M3FN>, %s: tensor<3x2xf32>) {
  %r = lowp.dequantize %v, %s : tensor<8x4xf8E4M3FN>, tensor<3x2xf32> -> tensor<8x4xf32>
  func.return
}

// CHECK: dequantize scales f32[3, 2] do not divide values f8e4m3[8, 4] into blocks (same rank, each axis of the values a multiple of the scales')

// -----

func.func @dequantize_result(%v: tensor<8x4xf8E4M3FN>, %s: tensor<2x2xf32>) {
  %r = lowp.dequantize %v, %s : tensor<8x4xf8E4M3FN>, tensor<2x2xf32> -> tensor<8x4xbf16>
  func.return
}

// CHECK: result must be f32 of the values' shape

// -----

func.func @scaled_matmul_shapes(%x: tensor<4x256xf8E4M3FN>, %w: tensor<128x128xf8E4M3FN>, %xs: tensor<4x2xf32>, %ws: tensor<1x1xf32>) {
  %y = lowp.scaled_matmul %x, %w scales %xs, %ws : tensor<4x256xf8E4M3FN>, tensor<128x128xf8E4M3FN>, tensor<4x2xf32>, tensor<1x1xf32> -> tensor<4x128xbf16>
  func.return
}

// CHECK: scaled_matmul takes [M, K] and [K, N], got f8e4m3[4, 256] and f8e4m3[128, 128]

// -----

func.func @scaled_matmul_pair(%x: tensor<4x256xf8E4M3FN>, %w: tensor<256x128xf8E5M2>, %xs: tensor<4x2xf32>, %ws: tensor<2x1xf32>) {
  %y = lowp.scaled_matmul %x, %w scales %xs, %ws : tensor<4x256xf8E4M3FN>, tensor<256x128xf8E5M2>, tensor<4x2xf32>, tensor<2x1xf32> -> tensor<4x128xbf16>
  func.return
}

// CHECK: scaled_matmul cannot multiply f8e4m3 by f8e5m2: the contraction engine takes matched pairs (f8e4m3 x f8e4m3; f8e5m2 x f8e5m2; f8e4m3 x f4e2m1 (the fetch stage's lookup table turns f4e2m1 into f8e4m3))

// -----

func.func @scaled_matmul_row_scales(%x: tensor<4x256xf8E4M3FN>, %w: tensor<256x128xf8E4M3FN>, %xs: tensor<2x2xf32>, %ws: tensor<2x1xf32>) {
  %y = lowp.scaled_matmul %x, %w scales %xs, %ws : tensor<4x256xf8E4M3FN>, tensor<256x128xf8E4M3FN>, tensor<2x2xf32>, tensor<2x1xf32> -> tensor<4x128xbf16>
  func.return
}

// CHECK: input scales must be per row (one scale per row and K-group)

// -----

func.func @scaled_matmul_k_blocks(%x: tensor<4x256xf8E4M3FN>, %w: tensor<256x128xf8E4M3FN>, %xs: tensor<4x2xf32>, %ws: tensor<3x1xf32>) {
  %y = lowp.scaled_matmul %x, %w scales %xs, %ws : tensor<4x256xf8E4M3FN>, tensor<256x128xf8E4M3FN>, tensor<4x2xf32>, tensor<3x1xf32> -> tensor<4x128xbf16>
  func.return
}

// CHECK: weight scales f32[3, 1] do not divide values f8e4m3[256, 128] into blocks (same rank, each axis of the values a multiple of the scales')

// -----

func.func @scaled_matmul_result(%x: tensor<4x256xf8E4M3FN>, %w: tensor<256x128xf8E4M3FN>, %xs: tensor<4x2xf32>, %ws: tensor<2x1xf32>) {
  %y = lowp.scaled_matmul %x, %w scales %xs, %ws : tensor<4x256xf8E4M3FN>, tensor<256x128xf8E4M3FN>, tensor<4x2xf32>, tensor<2x1xf32> -> tensor<4x64xbf16>
  func.return
}

// CHECK: result must be a float [4, 128]
