// RUN: tcpc-opt %s -p lower-quant | filecheck %s
// RUN: tcpc-opt %s -p lower-quant --print-op-generic | tcpc-opt | filecheck %s

// scaled_matmul (a dense fp8 layer, such as DeepSeek-V3's shared expert): one block-scaled
// contraction on [1, M, K] x [1, K, N] views, its f32 result rounded once to bf16.

func.func @shared(%x: tensor<4x256xf8E4M3FN>, %w: tensor<256x128xf8E4M3FN>, %xs: tensor<4x2xf32>, %ws: tensor<2x1xf32>) -> tensor<4x128xbf16> {
  %y = lowp.scaled_matmul %x, %w scales %xs, %ws : tensor<4x256xf8E4M3FN>, tensor<256x128xf8E4M3FN>, tensor<4x2xf32>, tensor<2x1xf32> -> tensor<4x128xbf16>
  func.return %y : tensor<4x128xbf16>
}

// CHECK-LABEL: func.func @shared
// CHECK:       %x_batch = tcp.view %x : tensor<4x256xf8E4M3FN> -> tensor<1x4x256xf8E4M3FN>
// CHECK-NEXT:  %w_batch = tcp.view %w : tensor<256x128xf8E4M3FN> -> tensor<1x256x128xf8E4M3FN>
// CHECK-NEXT:  %x_scales_batch = tcp.view %xs : tensor<4x2xf32> -> tensor<1x4x2xf32>
// CHECK-NEXT:  %w_scales_batch = tcp.view %ws : tensor<2x1xf32> -> tensor<1x2x1xf32>
// CHECK-NEXT:  %y_acc = tcp.scaled_contract %x_batch, %w_batch scales %x_scales_batch, %w_scales_batch : tensor<1x4x256xf8E4M3FN>, tensor<1x256x128xf8E4M3FN>, tensor<1x4x2xf32>, tensor<1x2x1xf32> -> tensor<1x4x128xf32>
// CHECK-NEXT:  %y_f32 = tcp.view %y_acc : tensor<1x4x128xf32> -> tensor<4x128xf32>
// CHECK-NEXT:  %y = ve.narrow %y_f32 : tensor<4x128xf32> -> tensor<4x128xbf16>
