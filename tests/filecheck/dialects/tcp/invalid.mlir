// RUN: tcpc-opt %s --split-input-file --verify-diagnostics | filecheck %s

// The tcp verifier's cases: each split case is rejected with the message checked after it.

func.func @contract_shape(%a: tensor<3x2x4xbf16>, %w: tensor<3x4x5xbf16>) -> tensor<3x2x5xf32> {
  %y = tcp.contract "gbd,gdf->gbd" %a, %w : tensor<3x2x4xbf16>, tensor<3x4x5xbf16> -> tensor<3x2x5xf32>
  func.return %y : tensor<3x2x5xf32>
}

// CHECK: result should have shape [3, 2, 4]

// -----

func.func @acc_bf16(%a: tensor<2x2x8xbf16>, %w: tensor<2x8x3xbf16>, %acc: tensor<2x2x3xbf16>) -> tensor<2x2x3xf32> {
  %y = tcp.contract "gbd,gdf->gbf" %a, %w acc %acc : tensor<2x2x8xbf16>, tensor<2x8x3xbf16> acc tensor<2x2x3xbf16> -> tensor<2x2x3xf32>
  func.return %y : tensor<2x2x3xf32>
}

// CHECK: the accumulator and the result must both be f32[2, 2, 3], got bf16[2, 2, 3] and f32[2, 2, 3]

// -----

func.func @result_bf16_with_acc(%a: tensor<2x2x8xbf16>, %w: tensor<2x8x3xbf16>, %acc: tensor<2x2x3xf32>) -> tensor<2x2x3xbf16> {
  %y = tcp.contract "gbd,gdf->gbf" %a, %w acc %acc : tensor<2x2x8xbf16>, tensor<2x8x3xbf16> acc tensor<2x2x3xf32> -> tensor<2x2x3xbf16>
  func.return %y : tensor<2x2x3xbf16>
}

// CHECK: the accumulator and the result must both be f32[2, 2, 3], got f32[2, 2, 3] and bf16[2, 2, 3]

// -----

func.func @acc_shape(%a: tensor<2x2x8xbf16>, %w: tensor<2x8x3xbf16>, %acc: tensor<2x3x3xf32>) -> tensor<2x2x3xf32> {
  %y = tcp.contract "gbd,gdf->gbf" %a, %w acc %acc : tensor<2x2x8xbf16>, tensor<2x8x3xbf16> acc tensor<2x3x3xf32> -> tensor<2x2x3xf32>
  func.return %y : tensor<2x2x3xf32>
}

// CHECK: the accumulator and the result must both be f32[2, 2, 3], got f32[2, 3, 3] and f32[2, 2, 3]

// -----

func.func @scaled_acc_shape(%a: tensor<2x2x8xf8E4M3FN>, %w: tensor<2x8x4xf8E4M3FN>, %as: tensor<2x2x2xf32>, %ws: tensor<2x2x2xf32>, %acc: tensor<2x2x3xf32>) -> tensor<2x2x4xf32> {
  %y = tcp.scaled_contract %a, %w scales %as, %ws acc %acc : tensor<2x2x8xf8E4M3FN>, tensor<2x8x4xf8E4M3FN>, tensor<2x2x2xf32>, tensor<2x2x2xf32> acc tensor<2x2x3xf32> -> tensor<2x2x4xf32>
  func.return %y : tensor<2x2x4xf32>
}

// CHECK: the accumulator must be the result's f32[2, 2, 4], got f32[2, 2, 3]

// -----

func.func @gather_rows(%w: tensor<3x8x6xbf16>, %ei: tensor<5xi32>) -> tensor<5x8x5xbf16> {
  %wg = tcp.dma_gather %w[%ei] : tensor<3x8x6xbf16>, tensor<5xi32> -> tensor<5x8x5xbf16>
  func.return %wg : tensor<5x8x5xbf16>
}

// CHECK: result should be tensor<5x8x6xbf16>

// -----

func.func @scatter_indices(%x: tensor<4x8xbf16>, %si: tensor<3x2xi32>) -> tensor<10x8xbf16> {
  %rows = tcp.dma_scatter %x[%si] : tensor<4x8xbf16>, tensor<3x2xi32> -> tensor<10x8xbf16>
  func.return %rows : tensor<10x8xbf16>
}

// CHECK: indices i32[3, 2] must have one leading entry per source row (4)

// -----

func.func @copy_type(%x: tensor<4x8xbf16>) -> tensor<4x8xf32> {
  %s = tcp.load %x : tensor<4x8xbf16> -> tensor<4x8xf32>
  func.return %s : tensor<4x8xf32>
}

// CHECK: a copy keeps the type

// -----

func.func @view_elements(%x: tensor<4x8xbf16>) -> tensor<5x8xbf16> {
  %v = tcp.view %x : tensor<4x8xbf16> -> tensor<5x8xbf16>
  func.return %v : tensor<5x8xbf16>
}

// CHECK: cannot view bf16[4, 8] to bf16[5, 8]

// -----

func.func @mapping_lanes(%a: tensor<8x64xbf16>, %w: tensor<64x16xbf16>) -> tensor<8x16xf32> {
  %y = tcp.contract "mk,kn->mn" %a, %w : tensor<8x64xbf16>, tensor<64x16xbf16> -> tensor<8x16xf32> {mapping = #tcp.mapping<trf = rhs, slices = [1, 1, 1], lanes = 16, broadcast = 1, packet = 32, k_chunk = 64, trf_mode = half>}
  func.return %y : tensor<8x16xf32>
}

// CHECK: #tcp.mapping: lanes = 16; the Outer stage takes 1, 2, 4 or 8

// -----

func.func @mapping_slices(%a: tensor<8x64xbf16>, %w: tensor<64x16xbf16>) -> tensor<8x16xf32> {
  %y = tcp.contract "mk,kn->mn" %a, %w : tensor<8x64xbf16>, tensor<64x16xbf16> -> tensor<8x16xf32> {mapping = #tcp.mapping<trf = rhs, slices = [1, 16, 1], lanes = 8, broadcast = 1, packet = 32, k_chunk = 64, trf_mode = half>}
  func.return %y : tensor<8x16xf32>
}

// CHECK: mapping splits m (size 8) over 16 slices

// -----

func.func @order_type(%routing: tensor<4x2xi32>, %top_e: tensor<4x2xi32>) -> tensor<4x3xi32> {
  %r = "tcp.order"(%routing, %top_e) : (tensor<4x2xi32>, tensor<4x2xi32>) -> tensor<4x3xi32>
  func.return %r : tensor<4x3xi32>
}

// CHECK: attribute tensor<4x2xi32> expected from variable 'T', but got tensor<4x3xi32>
