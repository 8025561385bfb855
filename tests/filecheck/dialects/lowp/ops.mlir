// RUN: tcpc-opt %s | filecheck %s
// RUN: tcpc-opt %s --print-op-generic | tcpc-opt | filecheck %s

// Every lowp op in its custom format, printed back unchanged and through the generic format.

func.func @pairs(%x: tensor<2x3x8xbf16>, %w: tensor<2x64x3xf4E2M1FN>, %ws: tensor<2x2x3xf8E8M0FNU>) -> (tensor<2x3x8xf32>, tensor<2x64x3xf32>) {
  %xq, %xs = lowp.quantize %x {group = 4 : i64} : tensor<2x3x8xbf16> -> tensor<2x3x8xf8E4M3FN>, tensor<2x3x2xf32>
  %xd = lowp.dequantize %xq, %xs : tensor<2x3x8xf8E4M3FN>, tensor<2x3x2xf32> -> tensor<2x3x8xf32>
  %wd = lowp.dequantize %w, %ws : tensor<2x64x3xf4E2M1FN>, tensor<2x2x3xf8E8M0FNU> -> tensor<2x64x3xf32>
  func.return %xd, %wd : tensor<2x3x8xf32>, tensor<2x64x3xf32>
}
func.func @matmul(%x: tensor<4x256xf8E4M3FN>, %w: tensor<256x128xf8E4M3FN>, %xs: tensor<4x2xf32>, %ws: tensor<2x1xf32>) -> tensor<4x128xbf16> {
  %y = lowp.scaled_matmul %x, %w scales %xs, %ws : tensor<4x256xf8E4M3FN>, tensor<256x128xf8E4M3FN>, tensor<4x2xf32>, tensor<2x1xf32> -> tensor<4x128xbf16>
  func.return %y : tensor<4x128xbf16>
}

// CHECK:      func.func @pairs(%x: tensor<2x3x8xbf16>, %w: tensor<2x64x3xf4E2M1FN>, %ws: tensor<2x2x3xf8E8M0FNU>) -> (tensor<2x3x8xf32>, tensor<2x64x3xf32>) {
// CHECK-NEXT:   %xq, %xs = lowp.quantize %x {group = 4 : i64} : tensor<2x3x8xbf16> -> tensor<2x3x8xf8E4M3FN>, tensor<2x3x2xf32>
// CHECK-NEXT:   %xd = lowp.dequantize %xq, %xs : tensor<2x3x8xf8E4M3FN>, tensor<2x3x2xf32> -> tensor<2x3x8xf32>
// CHECK-NEXT:   %wd = lowp.dequantize %w, %ws : tensor<2x64x3xf4E2M1FN>, tensor<2x2x3xf8E8M0FNU> -> tensor<2x64x3xf32>
// CHECK-NEXT:   func.return %xd, %wd : tensor<2x3x8xf32>, tensor<2x64x3xf32>
// CHECK-NEXT: }
// CHECK:      func.func @matmul(%x: tensor<4x256xf8E4M3FN>, %w: tensor<256x128xf8E4M3FN>, %xs: tensor<4x2xf32>, %ws: tensor<2x1xf32>) -> tensor<4x128xbf16> {
// CHECK-NEXT:   %y = lowp.scaled_matmul %x, %w scales %xs, %ws : tensor<4x256xf8E4M3FN>, tensor<256x128xf8E4M3FN>, tensor<4x2xf32>, tensor<2x1xf32> -> tensor<4x128xbf16>
// CHECK-NEXT:   func.return %y : tensor<4x128xbf16>
// CHECK-NEXT: }
