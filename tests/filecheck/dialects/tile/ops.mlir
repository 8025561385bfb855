// RUN: tcpc-opt %s | filecheck %s
// RUN: tcpc-opt %s --print-op-generic | tcpc-opt | filecheck %s

// Every tile op in its custom format, printed back unchanged and through the generic format.

func.func @tiles(%x: tensor<16x8xbf16>, %rows: tensor<1x4xi32>, %ids: tensor<1xi32>, %i: index, %wait: tensor<1xf32>) -> tensor<16x8xbf16> {
  %buf = tile.buffer "hbm" : tensor<16x8xbf16>
  %go = tile.guard %ids : tensor<1xi32>
  %part = tile.slice %x[%i] : tensor<16x8xbf16> -> tensor<4x8xbf16>
  %corner = tile.slice %x[%i] at array<i64: 4> : tensor<16x8xbf16> -> tensor<2x4xbf16>
  %t = tile.load %x[%i] guard %ids after %wait : tensor<16x8xbf16> guard tensor<1xi32> after tensor<1xf32> -> tensor<4x8xbf16>
  %g = tile.gather %x[%rows] after %wait : tensor<16x8xbf16>, tensor<1x4xi32> after tensor<1xf32> -> tensor<1x4x8xbf16>
  %c = tile.copy %t : tensor<4x8xbf16> -> tensor<4x8xbf16>
  %out = tile.store %c, %buf[%i] guard %ids : tensor<4x8xbf16>, tensor<16x8xbf16> guard tensor<1xi32> -> tensor<16x8xbf16>
  func.return %out : tensor<16x8xbf16>
}
func.func @parts(%c: tensor<4x8xbf16>, %buf: tensor<16x8xbf16>, %i: index, %blocks: tensor<2xi32>) -> tensor<16x8xbf16> {
  %out = tile.store %c, %buf[%i] guard %blocks : tensor<4x8xbf16>, tensor<16x8xbf16> guard tensor<2xi32> -> tensor<16x8xbf16>
  func.return %out : tensor<16x8xbf16>
}
func.func @columns(%c: tensor<1x2x4xf32>, %buf: tensor<1x2x8xf32>, %i: index) -> tensor<1x2x8xf32> {
  %out = tile.store %c, %buf[%i] at array<i64: 0, 4> : tensor<1x2x4xf32>, tensor<1x2x8xf32> -> tensor<1x2x8xf32>
  func.return %out : tensor<1x2x8xf32>
}
func.func @experts(%w: tensor<3x4x10xbf16>, %ids: tensor<1xi32>, %prev_ids: tensor<1xi32>, %prev: tensor<1x4x3xbf16>) -> (tensor<1x4x3xbf16>, tensor<1x4x10xbf16>) {
  %window = tile.load_expert %w[%ids] at array<i64: 0, 6> : tensor<3x4x10xbf16>, tensor<1xi32> -> tensor<1x4x3xbf16>
  %reused = tile.load_expert %w[%ids] reuse %prev_ids, %window after %prev : tensor<3x4x10xbf16>, tensor<1xi32>, tensor<1xi32>, tensor<1x4x3xbf16> after tensor<1x4x3xbf16> -> tensor<1x4x3xbf16>
  %whole = tile.load_expert %w[%ids] : tensor<3x4x10xbf16>, tensor<1xi32> -> tensor<1x4x10xbf16>
  func.return %reused, %whole : tensor<1x4x3xbf16>, tensor<1x4x10xbf16>
}

// CHECK:      func.func @tiles(%x: tensor<16x8xbf16>, %rows: tensor<1x4xi32>, %ids: tensor<1xi32>, %i: index, %wait: tensor<1xf32>) -> tensor<16x8xbf16> {
// CHECK-NEXT:   %buf = tile.buffer "hbm" : tensor<16x8xbf16>
// CHECK-NEXT:   %go = tile.guard %ids : tensor<1xi32>
// CHECK-NEXT:   %part = tile.slice %x[%i] : tensor<16x8xbf16> -> tensor<4x8xbf16>
// CHECK-NEXT:   %corner = tile.slice %x[%i] at array<i64: 4> : tensor<16x8xbf16> -> tensor<2x4xbf16>
// CHECK-NEXT:   %t = tile.load %x[%i] guard %ids after %wait : tensor<16x8xbf16> guard tensor<1xi32> after tensor<1xf32> -> tensor<4x8xbf16>
// CHECK-NEXT:   %g = tile.gather %x[%rows] after %wait : tensor<16x8xbf16>, tensor<1x4xi32> after tensor<1xf32> -> tensor<1x4x8xbf16>
// CHECK-NEXT:   %c = tile.copy %t : tensor<4x8xbf16> -> tensor<4x8xbf16>
// CHECK-NEXT:   %out = tile.store %c, %buf[%i] guard %ids : tensor<4x8xbf16>, tensor<16x8xbf16> guard tensor<1xi32> -> tensor<16x8xbf16>
// CHECK-NEXT:   func.return %out : tensor<16x8xbf16>
// CHECK-NEXT: }
// CHECK:      func.func @parts(%c: tensor<4x8xbf16>, %buf: tensor<16x8xbf16>, %i: index, %blocks: tensor<2xi32>) -> tensor<16x8xbf16> {
// CHECK-NEXT:   %out = tile.store %c, %buf[%i] guard %blocks : tensor<4x8xbf16>, tensor<16x8xbf16> guard tensor<2xi32> -> tensor<16x8xbf16>
// CHECK-NEXT:   func.return %out : tensor<16x8xbf16>
// CHECK-NEXT: }
// CHECK:      func.func @columns(%c: tensor<1x2x4xf32>, %buf: tensor<1x2x8xf32>, %i: index) -> tensor<1x2x8xf32> {
// CHECK-NEXT:   %out = tile.store %c, %buf[%i] at array<i64: 0, 4> : tensor<1x2x4xf32>, tensor<1x2x8xf32> -> tensor<1x2x8xf32>
// CHECK-NEXT:   func.return %out : tensor<1x2x8xf32>
// CHECK-NEXT: }
// CHECK:      func.func @experts(%w: tensor<3x4x10xbf16>, %ids: tensor<1xi32>, %prev_ids: tensor<1xi32>, %prev: tensor<1x4x3xbf16>) -> (tensor<1x4x3xbf16>, tensor<1x4x10xbf16>) {
// CHECK-NEXT:   %window = tile.load_expert %w[%ids] at array<i64: 0, 6> : tensor<3x4x10xbf16>, tensor<1xi32> -> tensor<1x4x3xbf16>
// CHECK-NEXT:   %reused = tile.load_expert %w[%ids] reuse %prev_ids, %window after %prev : tensor<3x4x10xbf16>, tensor<1xi32>, tensor<1xi32>, tensor<1x4x3xbf16> after tensor<1x4x3xbf16> -> tensor<1x4x3xbf16>
// CHECK-NEXT:   %whole = tile.load_expert %w[%ids] : tensor<3x4x10xbf16>, tensor<1xi32> -> tensor<1x4x10xbf16>
// CHECK-NEXT:   func.return %reused, %whole : tensor<1x4x3xbf16>, tensor<1x4x10xbf16>
// CHECK-NEXT: }
