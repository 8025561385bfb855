// RUN: not tcpc-opt %s -p map-contractions 2>&1 | filecheck %s

// A hand-written mapping that breaks a rule of the chip fails the pass with the op, the numbers
// and the limit: here the stationary weight ([32 x 1024] per lane) is more than the TRF holds.
func.func @too_big_for_the_trf(%x: tensor<256x1024xbf16>, %w: tensor<1024x1024xbf16>) -> tensor<256x1024xf32> {
  %y = tcp.contract "mk,kn->mn" %x, %w : tensor<256x1024xbf16>, tensor<1024x1024xbf16> -> tensor<256x1024xf32> {mapping = #tcp.mapping<trf = rhs, slices = [1, 1, 32], lanes = 8, broadcast = 4, packet = 32, k_chunk = 1024, trf_mode = half>}
  func.return %y : tensor<256x1024xf32>
}
// CHECK: map-contractions: tcp.contract (m=256, n=1024, k=1024) on rngd: the stationary operand needs 4096 elements per lane (broadcast 4 x k_chunk 1024); the TRF holds 2048 per lane with 8 lanes in half mode
