// RUN: tcpc-opt %s -p load-arguments | filecheck %s
// RUN: tcpc-opt %s -p load-arguments,load-arguments | filecheck %s --check-prefix=TWICE

// An argument an engine reads gets one load before its first reader; one read only by DMA stays in
// HBM; a view of an argument read by an engine reads the loaded copy.
func.func @f(%x: tensor<4x8xf32>, %w: tensor<3x8x2xf32>, %ids: tensor<3xi32>, %b: tensor<8xf32>) -> tensor<4x8xf32> {
  %wg = tcp.dma_gather %w[%ids] : tensor<3x8x2xf32>, tensor<3xi32> -> tensor<3x8x2xf32>
  %y = ve.add %x, %x : tensor<4x8xf32>
  %bb = ve.broadcast %b along 0 : tensor<8xf32> -> tensor<4x8xf32>
  %z = ve.mul %y, %bb : tensor<4x8xf32>
  func.return %z : tensor<4x8xf32>
}

// CHECK:      %wg = tcp.dma_gather %w[%ids]
// CHECK-NEXT: %x_sram = tcp.load %x : tensor<4x8xf32> -> tensor<4x8xf32>
// CHECK-NEXT: %y = ve.add %x_sram, %x_sram : tensor<4x8xf32>
// CHECK-NEXT: %b_sram = tcp.load %b : tensor<8xf32> -> tensor<8xf32>
// CHECK-NEXT: %bb = ve.broadcast %b_sram along 0
// CHECK-NOT:  tcp.load

// TWICE-COUNT-2: tcp.load
// TWICE-NOT:     tcp.load
