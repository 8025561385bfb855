// RUN: tcpc-opt %s --split-input-file --verify-diagnostics --parsing-diagnostics | filecheck %s

// The tile verifier's cases: each split case is rejected with the message checked after it.

func.func @load_expert_window_past_the_row(%w: tensor<3x4x10xbf16>, %ids: tensor<1xi32>) {
  %t = tile.load_expert %w[%ids] at array<i64: 0, 8> : tensor<3x4x10xbf16>, tensor<1xi32> -> tensor<1x4x3xbf16>
  func.return
}

// CHECK: tile.load_expert: bf16[1, 4, 3] at [0, 8] is not a window of the rows of bf16[3, 4, 10]

// -----

func.func @load_expert_window_past_the_rows(%w: tensor<3x4x10xbf16>, %ids: tensor<1xi32>) {
  %t = tile.load_expert %w[%ids] at array<i64: 1, 6> : tensor<3x4x10xbf16>, tensor<1xi32> -> tensor<1x4x3xbf16>
  func.return
}

// CHECK: tile.load_expert: bf16[1, 4, 3] at [1, 6] is not a window of the rows of bf16[3, 4, 10]

// -----

func.func @load_expert_window_rank(%w: tensor<3x4x10xbf16>, %ids: tensor<1xi32>) {
  %t = tile.load_expert %w[%ids] at array<i64: 6> : tensor<3x4x10xbf16>, tensor<1xi32> -> tensor<1x4x3xbf16>
  func.return
}

// CHECK: tile.load_expert: bf16[1, 4, 3] at [6] is not a window of the rows of bf16[3, 4, 10]

// -----

func.func @load_expert_reuse_ids(%w: tensor<3x4x10xbf16>, %ids: tensor<1xi32>, %prev_ids: tensor<2xi32>, %prev: tensor<1x4x10xbf16>) {
  %t = tile.load_expert %w[%ids] reuse %prev_ids, %prev : tensor<3x4x10xbf16>, tensor<1xi32>, tensor<2xi32>, tensor<1x4x10xbf16> -> tensor<1x4x10xbf16>
  func.return
}

// CHECK: tile.load_expert: prev_ids must have the type of ids

// -----

func.func @load_expert_reuse_tile(%w: tensor<3x4x10xbf16>, %ids: tensor<1xi32>, %prev_ids: tensor<1xi32>, %prev: tensor<1x4x3xbf16>) {
  %t = tile.load_expert %w[%ids] reuse %prev_ids, %prev : tensor<3x4x10xbf16>, tensor<1xi32>, tensor<1xi32>, tensor<1x4x3xbf16> -> tensor<1x4x10xbf16>
  func.return
}

// CHECK: tile.load_expert: prev_tile must have the result's type

// -----

func.func @load_expert_one_row_per_id(%w: tensor<3x4x10xbf16>, %ids: tensor<2xi32>) {
  %t = tile.load_expert %w[%ids] : tensor<3x4x10xbf16>, tensor<2xi32> -> tensor<1x4x10xbf16>
  func.return
}

// CHECK: tile.load_expert: bf16[1, 4, 10] has not one row per id of i32[2]

// -----

func.func @slice_window(%s: tensor<3x4x10xf32>, %i: index) {
  %t = tile.slice %s[%i] at array<i64: 3, 6> : tensor<3x4x10xf32> -> tensor<1x2x3xf32>
  func.return
}

// CHECK: tile.slice: f32[1, 2, 3] at [3, 6] is not a window of the rows of f32[3, 4, 10]

// -----

func.func @slice_more_rows(%s: tensor<3x4xf32>, %i: index) {
  %t = tile.slice %s[%i] : tensor<3x4xf32> -> tensor<5x4xf32>
  func.return
}

// CHECK: tile.slice: a tile of f32[3, 4] cannot be f32[5, 4]

// -----

func.func @gather_rows(%x: tensor<5x3xbf16>, %rows: tensor<1x4xi32>) {
  %t = tile.gather %x[%rows] : tensor<5x3xbf16>, tensor<1x4xi32> -> tensor<4x3xbf16>
  func.return
}

// CHECK: tile.gather: rows of bf16[5, 3] by i32[1, 4] cannot be bf16[4, 3]

// -----

func.func @gather_indices(%x: tensor<5x3xbf16>, %rows: tensor<1x4xf32>) {
  %t = tile.gather %x[%rows] : tensor<5x3xbf16>, tensor<1x4xf32> -> tensor<1x4x3xbf16>
  func.return
}

// CHECK: tile.gather: indices must be i32

// -----

func.func @buffer_space() {
  %t = tile.buffer "l2" : tensor<4xf32>
  func.return
}

// CHECK: tile.buffer: space must be one of hbm, sram, not 'l2'

// -----

func.func @store_result(%t: tensor<2x4xf32>, %d: tensor<8x4xf32>, %i: index) {
  %r = tile.store %t, %d[%i] : tensor<2x4xf32>, tensor<8x4xf32> -> tensor<8x2xf32>
  func.return
}

// CHECK: tile.store: the result is the destination buffer

// -----

func.func @store_parts(%t: tensor<3x4xf32>, %d: tensor<8x4xf32>, %i: index, %g: tensor<5xi32>) {
  %r = tile.store %t, %d[%i] guard %g : tensor<3x4xf32>, tensor<8x4xf32> guard tensor<5xi32> -> tensor<8x4xf32>
  func.return
}

// CHECK: tile.store: the guard must be i32 [n], n parts of f32[3, 4], got i32[5]

// -----

func.func @store_window_outside(%t: tensor<1x2x4xf32>, %d: tensor<1x2x8xf32>, %i: index) {
  %r = tile.store %t, %d[%i] at array<i64: 0, 6> : tensor<1x2x4xf32>, tensor<1x2x8xf32> -> tensor<1x2x8xf32>
  func.return
}

// CHECK: tile.store: f32[1, 2, 4] at [0, 6] is not a window of the rows of f32[1, 2, 8]

// -----

func.func @store_window_guard(%t: tensor<1x2x4xf32>, %d: tensor<1x2x8xf32>, %i: index, %g: tensor<1xi32>) {
  %r = tile.store %t, %d[%i] at array<i64: 0, 4> guard %g : tensor<1x2x4xf32>, tensor<1x2x8xf32> guard tensor<1xi32> -> tensor<1x2x8xf32>
  func.return
}

// CHECK: tile.store: a store into a window takes no guard

// -----

func.func @guard_ids(%ids: tensor<2x1xi32>) {
  %g = tile.guard %ids : tensor<2x1xi32>
  func.return
}

// CHECK: tile.guard: ids must be i32 [n]

// -----

func.func @copy_type(%t: tensor<4xf32>) {
  %c = tile.copy %t : tensor<4xf32> -> tensor<4xbf16>
  func.return
}

// CHECK: a copy keeps the type
