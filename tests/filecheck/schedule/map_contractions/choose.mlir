// RUN: tcpc-opt %s -p map-contractions | filecheck %s

// Every contraction gets the cheapest legal mapping on one RNGD cluster (target/contraction_mapping.py).

// [256, 512] x [512, 1024] bf16: every multiplier busy (2,048 cycles, the peak): 64 rows of x
// and 16 columns of w per slice, the weight stationary in the TRF, each streamed packet of x
// meeting two rows per lane (Time Broadcast 2, so fetch keeps up with the multipliers).
func.func @prefill(%x: tensor<256x512xbf16>, %w: tensor<512x1024xbf16>) -> tensor<256x1024xf32> {
  %y = tcp.contract "mk,kn->mn" %x, %w : tensor<256x512xbf16>, tensor<512x1024xbf16> -> tensor<256x1024xf32>
  func.return %y : tensor<256x1024xf32>
}
// CHECK-LABEL: func.func @prefill
// CHECK:       tcp.contract "mk,kn->mn" {{.*}} {mapping = #tcp.mapping<trf = rhs, slices = [1, 4, 64], lanes = 8, broadcast = 2, packet = 32, k_chunk = 512, trf_mode = half>}

// A guarded expert block at decode: 16 tokens, the weight streamed, the tokens in the TRF.
func.func @decode(%x: tensor<1x16x4096xbf16>, %w: tensor<1x4096x1792xbf16>, %g: tensor<1xi32>) -> tensor<1x16x1792xf32> {
  %y = tcp.contract "gbd,gdf->gbf" %x, %w guard %g : tensor<1x16x4096xbf16>, tensor<1x4096x1792xbf16> guard tensor<1xi32> -> tensor<1x16x1792xf32>
  func.return %y : tensor<1x16x1792xf32>
}
// CHECK-LABEL: func.func @decode
// CHECK:       mapping = #tcp.mapping<trf = lhs, slices = [1, 2, 128], lanes = 8, broadcast = 1, packet = 32, k_chunk = 2048, trf_mode = half>

// f32 x f32 has no multiplier pair. One token's logits take the vector engine's float fma
// (256 MACs per slice, 64 cycles) ...
func.func @router_decode(%x: tensor<1x2048xf32>, %w: tensor<2048x128xf32>) -> tensor<1x128xf32> {
  %y = tcp.contract "mk,kn->mn" %x, %w : tensor<1x2048xf32>, tensor<2048x128xf32> -> tensor<1x128xf32>
  func.return %y : tensor<1x128xf32>
}
// CHECK-LABEL: func.func @router_decode
// CHECK:       mapping = #tcp.mapping<vector, slices = [1, 1, 128]>

// ... and 64 tokens' the multipliers, on the operands' bf16 pieces: nine exact products per
// MAC (bf16x9), the pieces cut by one vector pass first.
func.func @router(%x: tensor<64x2048xf32>, %w: tensor<2048x128xf32>) -> tensor<64x128xf32> {
  %y = tcp.contract "mk,kn->mn" %x, %w : tensor<64x2048xf32>, tensor<2048x128xf32> -> tensor<64x128xf32>
  func.return %y : tensor<64x128xf32>
}
// CHECK-LABEL: func.func @router
// CHECK:       mapping = #tcp.mapping<bf16x9, trf = lhs, slices = [1, 8, 32], lanes = 8, broadcast = 1, packet = 32, k_chunk = 2048, trf_mode = half>

// A hand-written mapping is kept as written (and checked against the target): the book's
// degenerate "K in Time" kernel, one element per packet.
func.func @given(%x: tensor<512x32xbf16>, %w: tensor<32x8xbf16>) -> tensor<512x8xf32> {
  %y = tcp.contract "mk,kn->mn" %x, %w : tensor<512x32xbf16>, tensor<32x8xbf16> -> tensor<512x8xf32> {mapping = #tcp.mapping<trf = rhs, slices = [1, 256, 1], lanes = 8, broadcast = 1, packet = 1, k_chunk = 32, trf_mode = full>}
  func.return %y : tensor<512x8xf32>
}
// CHECK-LABEL: func.func @given
// CHECK:       mapping = #tcp.mapping<trf = rhs, slices = [1, 256, 1], lanes = 8, broadcast = 1, packet = 1, k_chunk = 32, trf_mode = full>

// A block-scaled fp8 contraction maps at the fp8 width: 64 elements per packet.
func.func @fp8(%x: tensor<1x64x2048xf8E4M3FN>, %xs: tensor<1x64x16xf32>, %w: tensor<1x2048x768xf8E4M3FN>, %ws: tensor<1x16x6xf32>) -> tensor<1x64x768xf32> {
  %y = tcp.scaled_contract %x, %w scales %xs, %ws : tensor<1x64x2048xf8E4M3FN>, tensor<1x2048x768xf8E4M3FN>, tensor<1x64x16xf32>, tensor<1x16x6xf32> -> tensor<1x64x768xf32>
  func.return %y : tensor<1x64x768xf32>
}
// CHECK-LABEL: func.func @fp8
// CHECK:       tcp.scaled_contract {{.*}} {mapping = #tcp.mapping<{{.*}}packet = 64,
