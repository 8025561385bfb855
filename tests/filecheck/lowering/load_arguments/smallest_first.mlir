// RUN: tcpc-opt %s -p load-arguments | filecheck %s

// Loads before the same reader are issued smallest first: the 512 KB router's load (one DMA
// piece, one engine) before the 8 MB of tokens (spread over the engines), so the router does
// not wait for an engine's part of the tokens' load (Qwen3-30B-A3B at T = 2048: the router's
// matmul starts at 6,393 cycles, not 8,390). Argument order breaks ties.
func.func @f(%x: tensor<2048x2048xbf16>, %router: tensor<2048x128xbf16>, %a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<2048x128xf32> {
  %logits = tcp.contract "mk,kn->mn" %x, %router : tensor<2048x2048xbf16>, tensor<2048x128xbf16> -> tensor<2048x128xf32>
  %s = ve.add %b, %a : tensor<4xf32>
  func.return %logits : tensor<2048x128xf32>
}

// CHECK:      %router_sram = tcp.load %router
// CHECK-NEXT: %x_sram = tcp.load %x
// CHECK-NEXT: %logits = tcp.contract "mk,kn->mn" %x_sram, %router_sram
// CHECK-NEXT: %a_sram = tcp.load %a
// CHECK-NEXT: %b_sram = tcp.load %b
// CHECK-NEXT: %s = ve.add %b_sram, %a_sram
