// RUN: tcpc-opt %s --split-input-file --verify-diagnostics --parsing-diagnostics | filecheck %s

// The tmath verifier's cases: each split case is rejected with the message checked after it.

func.func @constant_int() {
  %c = tmath.constant 1.5 : tensor<i32>
  func.return
}

// CHECK: i32 constant 1.5 is not an integer

// -----

func.func @add_broadcast(%a: tensor<4x3xf32>, %b: tensor<4xf32>) {
  %y = tmath.add %a, %b : (tensor<4x3xf32>, tensor<4xf32>) -> tensor<4x3xf32>
  func.return
}

// CHECK: shapes f32[4, 3] and f32[4] do not broadcast

// -----

func.func @add_mix(%a: tensor<4xf32>, %b: tensor<4xi32>) {
  %y = tmath.add %a, %b : (tensor<4xf32>, tensor<4xi32>) -> tensor<4xf32>
  func.return
}

// CHECK: element types of f32[4] and i32[4] do not mix

// -----

func.func @add_bool(%a: tensor<4xi1>) {
  %y = tmath.add %a, %a : (tensor<4xi1>, tensor<4xi1>) -> tensor<4xi1>
  func.return
}

// CHECK: tmath.add does not take booleans

// -----

func.func @div_int(%a: tensor<4xi32>) {
  %y = tmath.div %a, %a : (tensor<4xi32>, tensor<4xi32>) -> tensor<4xi32>
  func.return
}

// CHECK: tmath.div needs float operands

// -----

func.func @add_result(%a: tensor<2xf32>) {
  %y = tmath.add %a, %a : (tensor<2xf32>, tensor<2xf32>) -> tensor<2xbf16>
  func.return
}

// CHECK: result type should be tensor<2xf32>

// -----

func.func @cmp_predicate(%a: tensor<4xf32>) {
  %y = tmath.cmp "gte", %a, %a : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xi1>
  func.return
}

// CHECK: unknown predicate gte

// -----

func.func @cmp_result(%a: tensor<4xf32>) {
  %y = tmath.cmp "gt", %a, %a : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xi32>
  func.return
}

// CHECK: result must be i1 of the broadcast shape

// -----

func.func @select_condition(%c: tensor<4xi32>, %a: tensor<4xf32>) {
  %y = tmath.select %c, %a, %a : (tensor<4xi32>, tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
  func.return
}

// CHECK: condition must be i1

// -----

func.func @select_result(%c: tensor<4xi1>, %a: tensor<4xf32>) {
  %y = tmath.select %c, %a, %a : (tensor<4xi1>, tensor<4xf32>, tensor<4xf32>) -> tensor<4xbf16>
  func.return
}

// CHECK: result type mismatch

// -----

func.func @exp_int(%a: tensor<4xi32>) {
  %y = tmath.exp %a : tensor<4xi32> -> tensor<4xi32>
  func.return
}

// CHECK: tmath.exp needs float operands

// -----

func.func @exp_result(%a: tensor<4xf32>) {
  %y = tmath.exp %a : tensor<4xf32> -> tensor<4xbf16>
  func.return
}

// CHECK: result type must equal the operand type

// -----

func.func @softmax_axis(%a: tensor<4x8xf32>) {
  %y = tmath.softmax %a {axis = 2 : i64} : tensor<4x8xf32> -> tensor<4x8xf32>
  func.return
}

// CHECK: axis out of range

// -----

func.func @softmax_int(%a: tensor<4x8xi32>) {
  %y = tmath.softmax %a {axis = 1 : i64} : tensor<4x8xi32> -> tensor<4x8xi32>
  func.return
}

// CHECK: softmax needs a float operand

// -----

func.func @reduce_axes_sorted(%a: tensor<2x3xf32>) {
  %y = tmath.reduce_sum %a {axes = array<i64: 1, 0>} : tensor<2x3xf32> -> tensor<f32>
  func.return
}

// CHECK: axes must be sorted and distinct

// -----

func.func @reduce_axis_range(%a: tensor<2x3xf32>) {
  %y = tmath.reduce_max %a {axes = array<i64: 2>} : tensor<2x3xf32> -> tensor<2x3xf32>
  func.return
}

// CHECK: axis out of range

// -----

func.func @reduce_result(%a: tensor<2x3xf32>) {
  %y = tmath.reduce_min %a {axes = array<i64: 1>, keepdims} : tensor<2x3xf32> -> tensor<2xf32>
  func.return
}

// CHECK: result type should be tensor<2x1xf32>

// -----

func.func @reshape_elements(%a: tensor<2x3xf32>) {
  %y = tmath.reshape %a : tensor<2x3xf32> -> tensor<7xf32>
  func.return
}

// CHECK: cannot reshape f32[2, 3] to f32[7]

// -----

func.func @cast_shape(%a: tensor<2x3xf32>) {
  %y = tmath.cast %a : tensor<2x3xf32> -> tensor<6xbf16>
  func.return
}

// CHECK: cast keeps the shape

// -----

func.func @cast_to_bool(%a: tensor<2x3xf32>) {
  %y = tmath.cast %a : tensor<2x3xf32> -> tensor<2x3xi1>
  func.return
}

// CHECK: cannot cast to i1; compare instead

// -----

func.func @matmul_shapes(%a: tensor<4x8xf32>, %b: tensor<4x8xf32>) {
  %y = tmath.matmul %a, %b : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  func.return
}

// CHECK: cannot multiply f32[4, 8] by f32[4, 8]

// -----

func.func @matmul_int(%a: tensor<4x8xi32>, %b: tensor<8x2xi32>) {
  %y = tmath.matmul %a, %b : (tensor<4x8xi32>, tensor<8x2xi32>) -> tensor<4x2xi32>
  func.return
}

// CHECK: matmul needs float operands of one kind

// -----

func.func @matmul_result(%a: tensor<4x8xf32>, %b: tensor<8x2xf32>) {
  %y = tmath.matmul %a, %b : (tensor<4x8xf32>, tensor<8x2xf32>) -> tensor<4x3xf32>
  func.return
}

// CHECK: result type mismatch

// -----

func.func @one_hot_float(%a: tensor<4xf32>) {
  %y = tmath.one_hot %a : tensor<4xf32> -> tensor<4x8xi32>
  func.return
}

// CHECK: one_hot takes i32 indices

// -----

func.func @one_hot_shape(%a: tensor<4xi32>) {
  %y = tmath.one_hot %a : tensor<4xi32> -> tensor<3x8xi32>
  func.return
}

// CHECK: result shape must be the index shape plus depth

// -----

func.func @take_indices(%a: tensor<4x8xf32>, %i: tensor<4x2xf32>) {
  %y = tmath.take %a, %i : (tensor<4x8xf32>, tensor<4x2xf32>) -> tensor<4x2xf32>
  func.return
}

// CHECK: take needs i32 indices

// -----

func.func @take_leading(%a: tensor<4x8xf32>, %i: tensor<3x2xi32>) {
  %y = tmath.take %a, %i : (tensor<4x8xf32>, tensor<3x2xi32>) -> tensor<3x2xf32>
  func.return
}

// CHECK: leading shapes of input and indices must match

// -----

func.func @take_result(%a: tensor<4x8xf32>, %i: tensor<4x2xi32>) {
  %y = tmath.take %a, %i : (tensor<4x8xf32>, tensor<4x2xi32>) -> tensor<4x3xf32>
  func.return
}

// CHECK: result has the index shape and the input's type
