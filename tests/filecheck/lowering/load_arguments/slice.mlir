// RUN: tcpc-opt %s -p load-arguments | filecheck %s

// A chunk's rows of the tokens (shard-experts' `chunks`: a tile.slice of the argument) address
// the argument where it is: read only by DMA (the dispatch's row scatter) they stay in HBM, so
// no whole SRAM copy of the tokens is kept for the chunks beside the router's tiles; a slice an
// engine reads reads the loaded copy.
func.func @f(%x: tensor<4x8xbf16>, %idx: tensor<2x2xi32>, %y: tensor<4x8xf32>) -> (tensor<4x8xbf16>, tensor<2x8xf32>) {
  %c0 = arith.constant 0 : index
  %x0 = tile.slice %x[%c0] : tensor<4x8xbf16> -> tensor<2x8xbf16>
  %send = tcp.dma_scatter %x0[%idx] : tensor<2x8xbf16>, tensor<2x2xi32> -> tensor<4x8xbf16>
  %y0 = tile.slice %y[%c0] : tensor<4x8xf32> -> tensor<2x8xf32>
  %z = ve.add %y0, %y0 : tensor<2x8xf32>
  func.return %send, %z : tensor<4x8xbf16>, tensor<2x8xf32>
}

// CHECK:      %x0 = tile.slice %x[%c0]
// CHECK-NEXT: %send = tcp.dma_scatter %x0[%idx]
// CHECK-NEXT: %y_sram = tcp.load %y : tensor<4x8xf32> -> tensor<4x8xf32>
// CHECK-NEXT: %y0 = tile.slice %y_sram[%c0]
// CHECK-NEXT: %z = ve.add %y0, %y0
// CHECK-NOT:  tcp.load %x
