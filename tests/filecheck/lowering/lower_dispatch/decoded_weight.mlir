// RUN: tcpc-opt %s -p lower-dispatch | filecheck %s
// RUN: tcpc-opt %s -p lower-dispatch --print-op-generic | tcpc-opt | filecheck %s

// A weight decoded for a bf16 contraction, bf16(dequantize(...)) of per-expert operands (the
// 3-bit trellis format: codes, group scales, sign vectors; the grid is the layer's), is decoded
// block by block: each per-expert operand gathered by expert_ids at its stored width, the
// dequantize and the rounding made again on the [G, ...] gathers, the whole-tensor decode
// gone. T = 6, K = 2, E = 4, B = 4: G = 6.

func.func @trellis(%x_blocked: tensor<6x4x40xbf16>, %scatter_idx: tensor<6x2xi32>, %expert_ids: tensor<6xi32>,
                   %c: tensor<4x40x32xui3>, %s: tensor<4x2x32xbf16>, %grid: tensor<8xf32>,
                   %su: tensor<4x40xbf16>, %sv: tensor<4x32xbf16>) -> tensor<6x4x32xbf16> {
  %route = moe.route %scatter_idx, %expert_ids : tensor<6x2xi32>, tensor<6xi32> -> !moe.route<T = 6, K = 2, E = 4, B = 4, G = 6>
  %real = lowp.dequantize %c, %s grid %grid su %su sv %sv {block = array<i64: 1, 32, 1>} : tensor<4x40x32xui3>, tensor<4x2x32xbf16> grid tensor<8xf32> su tensor<4x40xbf16> sv tensor<4x32xbf16> -> tensor<4x40x32xf32>
  %w = tmath.cast %real : tensor<4x40x32xf32> -> tensor<4x40x32xbf16>
  %up = moe.grouped_matmul %x_blocked, %w, %route : tensor<6x4x40xbf16>, tensor<4x40x32xbf16>, !moe.route<T = 6, K = 2, E = 4, B = 4, G = 6> -> tensor<6x4x32xbf16>
  func.return %up : tensor<6x4x32xbf16>
}

// CHECK-LABEL: func.func @trellis
// CHECK-NOT:   tensor<4x40x32xf32>
// CHECK:       %rows_valid = ve.broadcast %row_valid along 2 : tensor<6x4xi4> -> tensor<6x4x32xi4>
// CHECK-NEXT:  %w_gathered = tcp.dma_gather %c[%expert_ids] : tensor<4x40x32xui3>, tensor<6xi32> -> tensor<6x40x32xui3>
// CHECK-NEXT:  %w_scales_gathered = tcp.dma_gather %s[%expert_ids] : tensor<4x2x32xbf16>, tensor<6xi32> -> tensor<6x2x32xbf16>
// CHECK-NEXT:  %su_gathered = tcp.dma_gather %su[%expert_ids] : tensor<4x40xbf16>, tensor<6xi32> -> tensor<6x40xbf16>
// CHECK-NEXT:  %sv_gathered = tcp.dma_gather %sv[%expert_ids] : tensor<4x32xbf16>, tensor<6xi32> -> tensor<6x32xbf16>
// CHECK-NEXT:  %w_real = lowp.dequantize %w_gathered, %w_scales_gathered grid %grid su %su_gathered sv %sv_gathered {block = array<i64: 1, 32, 1>} : tensor<6x40x32xui3>, tensor<6x2x32xbf16> grid tensor<8xf32> su tensor<6x40xbf16> sv tensor<6x32xbf16> -> tensor<6x40x32xf32>
// CHECK-NEXT:  %w_decoded = tmath.cast %w_real : tensor<6x40x32xf32> -> tensor<6x40x32xbf16>
// CHECK-NEXT:  %y_acc = tcp.contract "gbd,gdf->gbf" %x_blocked, %w_decoded guard %expert_ids : tensor<6x4x40xbf16>, tensor<6x40x32xbf16> guard tensor<6xi32> -> tensor<6x4x32xf32>
// CHECK:       %up = ve.narrow %y_masked : tensor<6x4x32xf32> -> tensor<6x4x32xbf16>
// CHECK-NEXT:  func.return %up : tensor<6x4x32xbf16>

// A decoded weight read by something else too stays whole: gathered decoded, as any weight.

func.func @shared(%x_blocked: tensor<6x4x40xbf16>, %scatter_idx: tensor<6x2xi32>, %expert_ids: tensor<6xi32>,
                  %w4: tensor<4x40x32xf4E2M1FN>, %s: tensor<4x2x32xf32>) -> (tensor<6x4x32xbf16>, tensor<4x40x32xf32>) {
  %route = moe.route %scatter_idx, %expert_ids : tensor<6x2xi32>, tensor<6xi32> -> !moe.route<T = 6, K = 2, E = 4, B = 4, G = 6>
  %real = lowp.dequantize %w4, %s {block = array<i64: 1, 32, 1>} : tensor<4x40x32xf4E2M1FN>, tensor<4x2x32xf32> -> tensor<4x40x32xf32>
  %w = tmath.cast %real : tensor<4x40x32xf32> -> tensor<4x40x32xbf16>
  %up = moe.grouped_matmul %x_blocked, %w, %route : tensor<6x4x40xbf16>, tensor<4x40x32xbf16>, !moe.route<T = 6, K = 2, E = 4, B = 4, G = 6> -> tensor<6x4x32xbf16>
  func.return %up, %real : tensor<6x4x32xbf16>, tensor<4x40x32xf32>
}

// CHECK-LABEL: func.func @shared
// CHECK:       %real = lowp.dequantize %w4, %s {block = array<i64: 1, 32, 1>}
// CHECK-NEXT:  %w = tmath.cast %real : tensor<4x40x32xf32> -> tensor<4x40x32xbf16>
// CHECK:       %w_gathered = tcp.dma_gather %w[%expert_ids] : tensor<4x40x32xbf16>, tensor<6xi32> -> tensor<6x40x32xbf16>
