// RUN: tcpc-opt %s --split-input-file --verify-diagnostics --parsing-diagnostics | filecheck %s

// The moe verifier's cases (and the !moe.route type's): each split case is rejected with the message checked after it.

func.func @route_positive(%x: tensor<8x16xbf16>, %i: tensor<8x2xi32>) {
  %xb, %r = moe.scatter %x, %i : tensor<8x16xbf16>, tensor<8x2xi32> -> tensor<10x2x16xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 0, G = 10>
  func.return
}

// CHECK: !moe.route: T, K, E and B must be positive (T=8 K=2 E=4 B=0)

// -----

func.func @route_k_exceeds_e(%x: tensor<8x16xbf16>, %i: tensor<8x2xi32>) {
  %xb, %r = moe.scatter %x, %i : tensor<8x16xbf16>, tensor<8x2xi32> -> tensor<10x2x16xbf16>, !moe.route<T = 8, K = 5, E = 4, B = 2, G = 10>
  func.return
}

// CHECK: !moe.route: K = 5 exceeds E = 4

// -----

func.func @route_capacity(%x: tensor<8x16xbf16>, %i: tensor<8x2xi32>) {
  %xb, %r = moe.scatter %x, %i : tensor<8x16xbf16>, tensor<8x2xi32> -> tensor<10x2x16xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10, C = -1>
  func.return
}

// CHECK: !moe.route: capacity -1 is negative

// -----

func.func @route_blocks(%x: tensor<8x16xbf16>, %i: tensor<8x2xi32>) {
  %xb, %r = moe.scatter %x, %i : tensor<8x16xbf16>, tensor<8x2xi32> -> tensor<9x2x16xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 9>
  func.return
}

// CHECK: !moe.route: G = 9, but the worst case for this routing is 10

// -----

func.func @topk_k(%s: tensor<8x4xf32>) {
  %v, %i = moe.topk %s {k = 5 : i64} : tensor<8x4xf32> -> tensor<8x5xf32>, tensor<8x5xi32>
  func.return
}

// CHECK: k = 5 must be in [1, 4] (the last axis)

// -----

func.func @topk_order(%s: tensor<8x4xf32>) {
  %v, %i = moe.topk %s {k = 2 : i64, order = "random"} : tensor<8x4xf32> -> tensor<8x2xf32>, tensor<8x2xi32>
  func.return
}

// CHECK: order must be one of score, index

// -----

func.func @topk_values(%s: tensor<8x4xf32>) {
  %v, %i = moe.topk %s {k = 2 : i64} : tensor<8x4xf32> -> tensor<8x2xbf16>, tensor<8x2xi32>
  func.return
}

// CHECK: values type mismatch

// -----

func.func @topk_indices(%s: tensor<8x4xf32>) {
  %v, %i = moe.topk %s {k = 2 : i64} : tensor<8x4xf32> -> tensor<8x2xf32>, tensor<8x2xi64>
  func.return
}

// CHECK: indices must be i32 of the values' shape

// -----

func.func @scatter_indices(%x: tensor<7x16xbf16>, %i: tensor<7x2xi32>) {
  %xb, %r = moe.scatter %x, %i : tensor<7x16xbf16>, tensor<7x2xi32> -> tensor<10x2x16xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>
  func.return
}

// CHECK: expert indices i32[7, 2] do not match T = 8, K = 2

// -----

func.func @scatter_blocked(%x: tensor<8x16xbf16>, %i: tensor<8x2xi32>) {
  %xb, %r = moe.scatter %x, %i : tensor<8x16xbf16>, tensor<8x2xi32> -> tensor<10x2x8xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>
  func.return
}

// CHECK: blocked result should be tensor<10x2x16xbf16>

// -----

func.func @grouped_matmul_weight(%xb: tensor<10x2x16xbf16>, %w: tensor<3x16x32xbf16>, %r: !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>) {
  %y = moe.grouped_matmul %xb, %w, %r : tensor<10x2x16xbf16>, tensor<3x16x32xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10> -> tensor<10x2x32xbf16>
  func.return
}

// CHECK: weight bf16[3, 16, 32] is not [E, D, F] with E = 4, D = 16

// -----

func.func @grouped_matmul_bias(%xb: tensor<10x2x16xbf16>, %w: tensor<4x16x32xbf16>, %r: !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>, %b: tensor<4x16xf32>) {
  %y = moe.grouped_matmul %xb, %w, %r bias %b : tensor<10x2x16xbf16>, tensor<4x16x32xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>, tensor<4x16xf32> -> tensor<10x2x32xbf16>
  func.return
}

// CHECK: bias f32[4, 16] is not [E, F] = [4, 32]

// -----

func.func @grouped_matmul_int(%xb: tensor<10x2x16xi32>, %w: tensor<4x16x32xi32>, %r: !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>) {
  %y = moe.grouped_matmul %xb, %w, %r : tensor<10x2x16xi32>, tensor<4x16x32xi32>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10> -> tensor<10x2x32xi32>
  func.return
}

// CHECK: grouped_matmul needs float operands

// -----

func.func @grouped_matmul_result(%xb: tensor<10x2x16xbf16>, %w: tensor<4x16x32xbf16>, %r: !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>) {
  %y = moe.grouped_matmul %xb, %w, %r : tensor<10x2x16xbf16>, tensor<4x16x32xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10> -> tensor<10x2x16xbf16>
  func.return
}

// CHECK: result type mismatch: expected bf16[10, 2, 32] or its f32

// -----

func.func @scaled_input_scales(%xb: tensor<2x2x256xf8E4M3FN>, %w: tensor<2x256x256xf8E4M3FN>, %r: !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2>, %xs: tensor<2x1x2xf32>, %ws: tensor<2x2x2xf32>) {
  %y = moe.scaled_grouped_matmul %xb, %w, %r scales %xs, %ws : tensor<2x2x256xf8E4M3FN>, tensor<2x256x256xf8E4M3FN>, !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2>, tensor<2x1x2xf32>, tensor<2x2x2xf32> -> tensor<2x2x256xbf16>
  func.return
}

// CHECK: input scales must be per row: [G, B, D / group]

// -----

func.func @scaled_result(%xb: tensor<2x2x256xf8E4M3FN>, %w: tensor<2x256x256xf8E4M3FN>, %r: !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2>, %xs: tensor<2x2x2xf32>, %ws: tensor<2x2x2xf32>) {
  %y = moe.scaled_grouped_matmul %xb, %w, %r scales %xs, %ws : tensor<2x2x256xf8E4M3FN>, tensor<2x256x256xf8E4M3FN>, !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2>, tensor<2x2x2xf32>, tensor<2x2x2xf32> -> tensor<2x2x256xf32>
  func.return
}

// CHECK: result must be bf16 [G, B, F]

// -----

func.func @combine_int(%yb: tensor<10x2x16xi32>, %r: !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>) {
  %o = moe.combine %yb, %r : tensor<10x2x16xi32>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10> -> tensor<8x16xi32>
  func.return
}

// CHECK: combine needs a float input

// -----

func.func @combine_weights(%yb: tensor<10x2x16xf32>, %r: !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>, %p: tensor<8x3xf32>) {
  %o = moe.combine %yb, %r weights %p : tensor<10x2x16xf32>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>, tensor<8x3xf32> -> tensor<8x16xf32>
  func.return
}

// CHECK: weights f32[8, 3] are not [T, K] = [8, 2]

// -----

func.func @combine_result(%yb: tensor<10x2x16xf32>, %r: !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>) {
  %o = moe.combine %yb, %r : tensor<10x2x16xf32>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10> -> tensor<10x16xf32>
  func.return
}

// CHECK: result should be tensor<8x16xf32>

// -----

func.func @route_scatter_idx(%si: tensor<2x2xi32>, %ei: tensor<2xi32>) {
  %r = moe.route %si, %ei : tensor<2x2xi32>, tensor<2xi32> -> !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2>
  func.return
}

// CHECK: scatter_idx must be i32 [2, 1]

// -----

func.func @route_expert_ids(%si: tensor<2x1xi32>, %ei: tensor<3xi32>) {
  %r = moe.route %si, %ei : tensor<2x1xi32>, tensor<3xi32> -> !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2>
  func.return
}

// CHECK: expert_ids must be i32 [2]

// -----

func.func @dispatch_tokens(%x: tensor<3x4xbf16>, %r: !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2>) {
  %xb = moe.dispatch %x, %r : tensor<3x4xbf16>, !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2> -> tensor<2x2x4xbf16>
  func.return
}

// CHECK: input must be [T, D] with T = 2

// -----

func.func @dispatch_result(%x: tensor<2x4xbf16>, %r: !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2>) {
  %xb = moe.dispatch %x, %r : tensor<2x4xbf16>, !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2> -> tensor<2x2x4xf32>
  func.return
}

// CHECK: result should be tensor<2x2x4xbf16>

// -----

func.func @pair_rows_shape(%r: !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>) {
  %rows = moe.pair_rows %r : !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10> -> tensor<8x1xi32>
  func.return
}

// CHECK: rows must be tensor<8x2xi32>
