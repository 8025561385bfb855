// RUN: not tcpc-opt %s -p map-contractions 2>&1 | filecheck %s

// The bf16x9 route is for f32 x f32 only: a bf16 contraction has its multiplier pair.
func.func @pieces_of_bf16(%x: tensor<64x512xbf16>, %w: tensor<512x128xbf16>) -> tensor<64x128xf32> {
  %y = tcp.contract "mk,kn->mn" %x, %w : tensor<64x512xbf16>, tensor<512x128xbf16> -> tensor<64x128xf32> {mapping = #tcp.mapping<bf16x9, trf = lhs, slices = [1, 8, 32], lanes = 8, broadcast = 1, packet = 32, k_chunk = 512, trf_mode = half>}
  func.return %y : tensor<64x128xf32>
}
// CHECK: map-contractions: tcp.contract (m=64, n=128, k=512) on rngd: engine bf16x9 is a route of an f32 x f32 contraction; this one has a multiplier pair (engine contraction)
