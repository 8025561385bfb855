// RUN: tcpc-opt %s | filecheck %s
// RUN: tcpc-opt %s --print-op-generic | tcpc-opt | filecheck %s

// Every tcp op in its custom format, printed back unchanged and through the generic format.

func.func @f(%x: tensor<4x8xbf16>, %si: tensor<4x2xi32>, %ei: tensor<5xi32>, %w: tensor<3x8x6xbf16>, %b: tensor<5x1x6xf32>) -> (tensor<5x2x6xf32>, tensor<4x2x8xbf16>) {
  %r = moe.route %si, %ei : tensor<4x2xi32>, tensor<5xi32> -> !moe.route<T = 4, K = 2, E = 3, B = 2, G = 5>
  %xb = moe.dispatch %x, %r : tensor<4x8xbf16>, !moe.route<T = 4, K = 2, E = 3, B = 2, G = 5> -> tensor<5x2x8xbf16>
  %wg = tcp.dma_gather %w[%ei] : tensor<3x8x6xbf16>, tensor<5xi32> -> tensor<5x8x6xbf16>
  %y = tcp.contract "gbd,gdf->gbf" %xb, %wg bias %b guard %ei : tensor<5x2x8xbf16>, tensor<5x8x6xbf16> bias tensor<5x1x6xf32> guard tensor<5xi32> -> tensor<5x2x6xf32>
  %rows = tcp.dma_scatter %x[%si] : tensor<4x8xbf16>, tensor<4x2xi32> -> tensor<10x8xbf16>
  %blocks = tcp.view %rows : tensor<10x8xbf16> -> tensor<5x2x8xbf16>
  %flat = tcp.view %blocks : tensor<5x2x8xbf16> -> tensor<10x8xbf16>
  %back = tcp.dma_gather %flat[%si] : tensor<10x8xbf16>, tensor<4x2xi32> -> tensor<4x2x8xbf16>
  %s = tcp.load %back : tensor<4x2x8xbf16> -> tensor<4x2x8xbf16>
  %h = tcp.store %s : tensor<4x2x8xbf16> -> tensor<4x2x8xbf16>
  %si_ready = tcp.order %si after %ei : tensor<4x2xi32>, tensor<5xi32>
  func.return %y, %h : tensor<5x2x6xf32>, tensor<4x2x8xbf16>
}
func.func @g(%a: tensor<3x2x4xbf16>, %w: tensor<3x4x5xbf16>, %ids: tensor<3xi32>) -> tensor<3x2x5xf32> {
  %y = tcp.contract "gbd,gdf->gbf" %a, %w guard %ids : tensor<3x2x4xbf16>, tensor<3x4x5xbf16> guard tensor<3xi32> -> tensor<3x2x5xf32>
  func.return %y : tensor<3x2x5xf32>
}
func.func @k(%a: tensor<2x2x8xbf16>, %w: tensor<2x8x3xbf16>, %acc: tensor<2x2x3xf32>, %ids: tensor<2xi32>) -> tensor<2x2x3xf32> {
  %lo = tcp.contract "gbd,gdf->gbf" %a, %w acc %acc guard %ids : tensor<2x2x8xbf16>, tensor<2x8x3xbf16> acc tensor<2x2x3xf32> guard tensor<2xi32> -> tensor<2x2x3xf32>
  func.return %lo : tensor<2x2x3xf32>
}
func.func @s(%a: tensor<2x2x8xf8E4M3FN>, %w: tensor<2x8x4xf8E4M3FN>, %as: tensor<2x2x2xf32>, %ws: tensor<2x2x2xf32>, %acc: tensor<2x2x4xf32>, %ids: tensor<2xi32>) -> tensor<2x2x4xf32> {
  %y = tcp.scaled_contract %a, %w scales %as, %ws acc %acc guard %ids : tensor<2x2x8xf8E4M3FN>, tensor<2x8x4xf8E4M3FN>, tensor<2x2x2xf32>, tensor<2x2x2xf32> acc tensor<2x2x4xf32> guard tensor<2xi32> -> tensor<2x2x4xf32>
  func.return %y : tensor<2x2x4xf32>
}

func.func @m(%a: tensor<3x2x4xbf16>, %w: tensor<3x4x5xbf16>, %r: tensor<2x4xf32>, %q: tensor<4x8xf32>) -> (tensor<3x2x5xf32>, tensor<2x8xf32>) {
  %y = tcp.contract "gbd,gdf->gbf" %a, %w : tensor<3x2x4xbf16>, tensor<3x4x5xbf16> -> tensor<3x2x5xf32> {mapping = #tcp.mapping<trf = rhs, slices = [3, 2, 1], lanes = 8, broadcast = 1, packet = 16, k_chunk = 16, trf_mode = half>}
  %z = tcp.contract "mk,kn->mn" %r, %q : tensor<2x4xf32>, tensor<4x8xf32> -> tensor<2x8xf32> {mapping = #tcp.mapping<vector, slices = [1, 2, 8]>}
  %p = tcp.contract "mk,kn->mn" %r, %q : tensor<2x4xf32>, tensor<4x8xf32> -> tensor<2x8xf32> {mapping = #tcp.mapping<bf16x9, trf = rhs, slices = [1, 2, 1], lanes = 8, broadcast = 1, packet = 32, k_chunk = 64, trf_mode = half>}
  func.return %y, %z : tensor<3x2x5xf32>, tensor<2x8xf32>
}
// CHECK:      func.func @f(%x: tensor<4x8xbf16>, %si: tensor<4x2xi32>, %ei: tensor<5xi32>, %w: tensor<3x8x6xbf16>, %b: tensor<5x1x6xf32>) -> (tensor<5x2x6xf32>, tensor<4x2x8xbf16>) {
// CHECK-NEXT:   %r = moe.route %si, %ei : tensor<4x2xi32>, tensor<5xi32> -> !moe.route<T = 4, K = 2, E = 3, B = 2, G = 5>
// CHECK-NEXT:   %xb = moe.dispatch %x, %r : tensor<4x8xbf16>, !moe.route<T = 4, K = 2, E = 3, B = 2, G = 5> -> tensor<5x2x8xbf16>
// CHECK-NEXT:   %wg = tcp.dma_gather %w[%ei] : tensor<3x8x6xbf16>, tensor<5xi32> -> tensor<5x8x6xbf16>
// CHECK-NEXT:   %y = tcp.contract "gbd,gdf->gbf" %xb, %wg bias %b guard %ei : tensor<5x2x8xbf16>, tensor<5x8x6xbf16> bias tensor<5x1x6xf32> guard tensor<5xi32> -> tensor<5x2x6xf32>
// CHECK-NEXT:   %rows = tcp.dma_scatter %x[%si] : tensor<4x8xbf16>, tensor<4x2xi32> -> tensor<10x8xbf16>
// CHECK-NEXT:   %blocks = tcp.view %rows : tensor<10x8xbf16> -> tensor<5x2x8xbf16>
// CHECK-NEXT:   %flat = tcp.view %blocks : tensor<5x2x8xbf16> -> tensor<10x8xbf16>
// CHECK-NEXT:   %back = tcp.dma_gather %flat[%si] : tensor<10x8xbf16>, tensor<4x2xi32> -> tensor<4x2x8xbf16>
// CHECK-NEXT:   %s = tcp.load %back : tensor<4x2x8xbf16> -> tensor<4x2x8xbf16>
// CHECK-NEXT:   %h = tcp.store %s : tensor<4x2x8xbf16> -> tensor<4x2x8xbf16>
// CHECK-NEXT:   %si_ready = tcp.order %si after %ei : tensor<4x2xi32>, tensor<5xi32>
// CHECK-NEXT:   func.return %y, %h : tensor<5x2x6xf32>, tensor<4x2x8xbf16>
// CHECK-NEXT: }
// CHECK:      func.func @g(%a: tensor<3x2x4xbf16>, %w: tensor<3x4x5xbf16>, %ids: tensor<3xi32>) -> tensor<3x2x5xf32> {
// CHECK-NEXT:   %y = tcp.contract "gbd,gdf->gbf" %a, %w guard %ids : tensor<3x2x4xbf16>, tensor<3x4x5xbf16> guard tensor<3xi32> -> tensor<3x2x5xf32>
// CHECK-NEXT:   func.return %y : tensor<3x2x5xf32>
// CHECK-NEXT: }
// CHECK:      func.func @k(%a: tensor<2x2x8xbf16>, %w: tensor<2x8x3xbf16>, %acc: tensor<2x2x3xf32>, %ids: tensor<2xi32>) -> tensor<2x2x3xf32> {
// CHECK-NEXT:   %lo = tcp.contract "gbd,gdf->gbf" %a, %w acc %acc guard %ids : tensor<2x2x8xbf16>, tensor<2x8x3xbf16> acc tensor<2x2x3xf32> guard tensor<2xi32> -> tensor<2x2x3xf32>
// CHECK-NEXT:   func.return %lo : tensor<2x2x3xf32>
// CHECK-NEXT: }
// CHECK:      func.func @s(%a: tensor<2x2x8xf8E4M3FN>, %w: tensor<2x8x4xf8E4M3FN>, %as: tensor<2x2x2xf32>, %ws: tensor<2x2x2xf32>, %acc: tensor<2x2x4xf32>, %ids: tensor<2xi32>) -> tensor<2x2x4xf32> {
// CHECK-NEXT:   %y = tcp.scaled_contract %a, %w scales %as, %ws acc %acc guard %ids : tensor<2x2x8xf8E4M3FN>, tensor<2x8x4xf8E4M3FN>, tensor<2x2x2xf32>, tensor<2x2x2xf32> acc tensor<2x2x4xf32> guard tensor<2xi32> -> tensor<2x2x4xf32>
// CHECK-NEXT:   func.return %y : tensor<2x2x4xf32>
// CHECK-NEXT: }
// CHECK:      func.func @m(
// CHECK-NEXT:   %y = tcp.contract "gbd,gdf->gbf" %a, %w : tensor<3x2x4xbf16>, tensor<3x4x5xbf16> -> tensor<3x2x5xf32> {mapping = #tcp.mapping<trf = rhs, slices = [3, 2, 1], lanes = 8, broadcast = 1, packet = 16, k_chunk = 16, trf_mode = half>}
// CHECK-NEXT:   %z = tcp.contract "mk,kn->mn" %r, %q : tensor<2x4xf32>, tensor<4x8xf32> -> tensor<2x8xf32> {mapping = #tcp.mapping<vector, slices = [1, 2, 8]>}
// CHECK-NEXT:   %p = tcp.contract "mk,kn->mn" %r, %q : tensor<2x4xf32>, tensor<4x8xf32> -> tensor<2x8xf32> {mapping = #tcp.mapping<bf16x9, trf = rhs, slices = [1, 2, 1], lanes = 8, broadcast = 1, packet = 32, k_chunk = 64, trf_mode = half>}
