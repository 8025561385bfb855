// RUN: tcpc-opt %s -p lower-dispatch | filecheck %s
// RUN: tcpc-opt %s -p lower-dispatch --print-op-generic | tcpc-opt | filecheck %s

// Dispatch: one DMA row scatter of the tokens into a zeroed buffer of G*B rows (each token to
// its K rows, -1 skipped), viewed as [G, B, D]. The route is erased once nothing reads it.
// T = 6 tokens, K = 2, E = 4 experts, B = 4 rows per block: G = 6 blocks.

func.func @dispatch(%x: tensor<6x16xbf16>, %scatter_idx: tensor<6x2xi32>, %expert_ids: tensor<6xi32>) -> tensor<6x4x16xbf16> {
  %route = moe.route %scatter_idx, %expert_ids : tensor<6x2xi32>, tensor<6xi32> -> !moe.route<T = 6, K = 2, E = 4, B = 4, G = 6>
  %x_blocked = moe.dispatch %x, %route : tensor<6x16xbf16>, !moe.route<T = 6, K = 2, E = 4, B = 4, G = 6> -> tensor<6x4x16xbf16>
  func.return %x_blocked : tensor<6x4x16xbf16>
}

// CHECK-LABEL: func.func @dispatch
// CHECK-NOT:   moe.
// CHECK:       %x_rows = tcp.dma_scatter %x[%scatter_idx] : tensor<6x16xbf16>, tensor<6x2xi32> -> tensor<24x16xbf16>
// CHECK-NEXT:  %x_blocked = tcp.view %x_rows : tensor<24x16xbf16> -> tensor<6x4x16xbf16>
// CHECK-NEXT:  func.return %x_blocked : tensor<6x4x16xbf16>
