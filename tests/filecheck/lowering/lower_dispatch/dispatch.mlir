// RUN: tcpc-opt %s -p lower-dispatch | filecheck %s
// RUN: tcpc-opt %s -p lower-dispatch --print-op-generic | tcpc-opt | filecheck %s

// Dispatch: the token of every row of the G*B blocked rows (a DMA scatter of the token numbers
// plus one by scatter_idx into zeroed rows, minus one: -1 on padding rows), then one DMA row
// gather of the tokens by it, [G, B, D] (a -1 row reads nothing and is zero). The route is
// erased once nothing reads it.
// T = 6 tokens, K = 2, E = 4 experts, B = 4 rows per block: G = 6 blocks.

func.func @dispatch(%x: tensor<6x16xbf16>, %scatter_idx: tensor<6x2xi32>, %expert_ids: tensor<6xi32>) -> tensor<6x4x16xbf16> {
  %route = moe.route %scatter_idx, %expert_ids : tensor<6x2xi32>, tensor<6xi32> -> !moe.route<T = 6, K = 2, E = 4, B = 4, G = 6>
  %x_blocked = moe.dispatch %x, %route : tensor<6x16xbf16>, !moe.route<T = 6, K = 2, E = 4, B = 4, G = 6> -> tensor<6x4x16xbf16>
  func.return %x_blocked : tensor<6x4x16xbf16>
}

// CHECK-LABEL: func.func @dispatch
// CHECK-NOT:   moe.
// CHECK:       %token_numbers = ve.iota along 0 : tensor<6x1xi32>
// CHECK-NEXT:  %ones = ve.const 1 : tensor<6x1xi32>
// CHECK-NEXT:  %token_marks = ve.add %token_numbers, %ones : tensor<6x1xi32>
// CHECK-NEXT:  %row_marks = tcp.dma_scatter %token_marks[%scatter_idx] : tensor<6x1xi32>, tensor<6x2xi32> -> tensor<24x1xi32>
// CHECK-NEXT:  %block_marks = tcp.view %row_marks : tensor<24x1xi32> -> tensor<6x4xi32>
// CHECK-NEXT:  %ones_1 = ve.const 1 : tensor<6x4xi32>
// CHECK-NEXT:  %block_tokens = ve.sub %block_marks, %ones_1 : tensor<6x4xi32> {tcpc.phase = "dispatch"}
// CHECK-NEXT:  %x_blocked = tcp.dma_gather %x[%block_tokens] : tensor<6x16xbf16>, tensor<6x4xi32> -> tensor<6x4x16xbf16> {tcpc.phase = "dispatch"}
// CHECK-NEXT:  func.return %x_blocked : tensor<6x4x16xbf16>
