// RUN: tcpc-opt %s --split-input-file --verify-diagnostics --parsing-diagnostics | filecheck %s

// The ccl verifier's cases: each split case is rejected with the message checked after it.

func.func @chips_positive(%c: tensor<2xi32>) {
  %r = ccl.all_to_all %c over "ep" {chips = 0 : i64} : tensor<2xi32> -> tensor<2xi32>
  func.return
}

// CHECK: chips must be positive, got 0

// -----

func.func @all_to_all_slices(%x: tensor<3x5xi32>) {
  %r = ccl.all_to_all %x over "ep" {chips = 2 : i64} : tensor<3x5xi32> -> tensor<3x5xi32>
  func.return
}

// CHECK: input i32[3, 5] needs one slice per chip: a leading axis of 2

// -----

func.func @all_to_all_result(%x: tensor<2x5xi32>) {
  %r = ccl.all_to_all %x over "ep" {chips = 2 : i64} : tensor<2x5xi32> -> tensor<2x5xf32>
  func.return
}

// CHECK: result should be i32[2, 5]

// -----

func.func @all_to_all_rows(%x: tensor<2x5xi32>, %n: tensor<3xi32>) {
  %r = ccl.all_to_all %x rows %n over "ep" {chips = 2 : i64} : tensor<2x5xi32>, tensor<3xi32> -> tensor<2x5xi32>
  func.return
}

// CHECK: rows must be i32 [2]

// -----

func.func @packed_needs_rows(%x: tensor<2x4x8xbf16>) {
  %r = ccl.all_to_all %x over "ep" {chips = 2 : i64, packed} : tensor<2x4x8xbf16> -> tensor<2x4x8xbf16>
  func.return
}

// CHECK: packed needs rows (how many of the input's rows each slice takes) and slices of rows

// -----

func.func @all_gather_result(%x: tensor<2x8xbf16>) {
  %r = ccl.all_gather %x over "ep" {chips = 2 : i64} : tensor<2x8xbf16> -> tensor<2x8xbf16>
  func.return
}

// CHECK: result should be bf16[4, 8]

// -----

func.func @reduce_scatter_float(%x: tensor<4x8xi32>) {
  %r = ccl.reduce_scatter %x over "ep" {chips = 2 : i64} : tensor<4x8xi32> -> tensor<2x8xi32>
  func.return
}

// CHECK: reductions take float tensors

// -----

func.func @reduce_scatter_divides(%x: tensor<3x8xf32>) {
  %r = ccl.reduce_scatter %x over "ep" {chips = 2 : i64} : tensor<3x8xf32> -> tensor<1x8xf32>
  func.return
}

// CHECK: input f32[3, 8]: axis 0 must divide by 2

// -----

func.func @reduce_scatter_result(%x: tensor<4x8xf32>) {
  %r = ccl.reduce_scatter %x over "ep" {chips = 2 : i64} : tensor<4x8xf32> -> tensor<4x8xf32>
  func.return
}

// CHECK: result should be f32[2, 8]

// -----

func.func @reduce_scatter_dim(%x: tensor<4x8xf32>) {
  %r = ccl.reduce_scatter %x over "ep" {chips = 2 : i64, dim = 2 : i64} : tensor<4x8xf32> -> tensor<4x8xf32>
  func.return
}

// CHECK: input f32[4, 8]: axis 2 must divide by 2

// -----

func.func @reduce_scatter_rows(%x: tensor<2x4x8xf32>, %n: tensor<2xi32>) {
  %r = ccl.reduce_scatter %x rows %n over "tp" {chips = 2 : i64, dim = 1 : i64} : tensor<2x4x8xf32>, tensor<2xi32> -> tensor<2x2x8xf32>
  func.return
}

// CHECK: rows must be i32 [2], one count per slice of the input's first axis, and dim past the slices' rows (at least 2)

// -----

func.func @all_gather_dim(%x: tensor<2x8xbf16>) {
  %r = ccl.all_gather %x over "ep" {chips = 2 : i64, dim = 2 : i64} : tensor<2x8xbf16> -> tensor<2x8xbf16>
  func.return
}

// CHECK: dim 2 is not an axis of bf16[2, 8]

// -----

func.func @all_reduce_float(%x: tensor<3x5xi32>) {
  %r = ccl.all_reduce %x over "ep" {chips = 3 : i64} : tensor<3x5xi32> -> tensor<3x5xi32>
  func.return
}

// CHECK: reductions take float tensors

// -----

func.func @all_reduce_rows(%x: tensor<2x4x8xf32>, %n: tensor<4xi32>) {
  %r = ccl.all_reduce %x rows %n over "tp" {chips = 2 : i64} : tensor<2x4x8xf32>, tensor<4xi32> -> tensor<2x4x8xf32>
  func.return
}

// CHECK: rows must be i32 [2], one count per slice of a rank-2 or higher input

// -----

func.func @chip_id_result() {
  %c = ccl.chip_id over "ep" {chips = 2 : i64} : tensor<1xi32>
  func.return
}

// CHECK: result must be a scalar i32

// -----

func.func @a2a_plan_experts(%e: tensor<4x2xi32>) {
  %r, %s, %c = ccl.a2a_plan %e over "ep" {chips = 3 : i64, experts = 8 : i64, capacity = 0 : i64} : tensor<4x2xi32> -> tensor<4x2xi32>, tensor<3x8xi32>, tensor<3xi32>
  func.return
}

// CHECK: 8 experts do not divide over 3 chips

// -----

func.func @a2a_plan_capacity(%e: tensor<2x2xi32>) {
  %r, %s, %c = ccl.a2a_plan %e over "ep" {chips = 2 : i64, experts = 4 : i64, capacity = -1 : i64} : tensor<2x2xi32> -> tensor<2x2xi32>, tensor<2x4xi32>, tensor<2xi32>
  func.return
}

// CHECK: capacity must not be negative

// -----

func.func @a2a_plan_indices(%e: tensor<2x2xf32>) {
  %r, %s, %c = ccl.a2a_plan %e over "ep" {chips = 2 : i64, experts = 4 : i64, capacity = 0 : i64} : tensor<2x2xf32> -> tensor<2x2xi32>, tensor<2x4xi32>, tensor<2xi32>
  func.return
}

// CHECK: expert indices f32[2, 2] are not i32 [T, K]

// -----

func.func @a2a_plan_slots(%e: tensor<2x2xi32>) {
  %r, %s, %c = ccl.a2a_plan %e over "ep" {chips = 2 : i64, experts = 4 : i64, capacity = 0 : i64} : tensor<2x2xi32> -> tensor<2x2xi32>, tensor<2x3xi32>, tensor<2xi32>
  func.return
}

// CHECK: slot_experts must be i32 [2, 4] (the worst case: a2a_slots)

// -----

func.func @a2a_plan_counts(%e: tensor<2x2xi32>) {
  %r, %s, %c = ccl.a2a_plan %e over "ep" {chips = 2 : i64, experts = 4 : i64, capacity = 0 : i64} : tensor<2x2xi32> -> tensor<2x2xi32>, tensor<2x4xi32>, tensor<3xi32>
  func.return
}

// CHECK: counts must be i32 [2]

// -----

func.func @a2a_plan_chip_counts_need_capacity(%e: tensor<2x2xi32>, %cc: tensor<2x4xi32>) {
  %r, %s, %c = ccl.a2a_plan %e after %cc over "ep" {chips = 2 : i64, experts = 4 : i64, capacity = 0 : i64} : tensor<2x2xi32>, tensor<2x4xi32> -> tensor<2x2xi32>, tensor<2x4xi32>, tensor<2xi32>
  func.return
}

// CHECK: chip_counts rank pairs for a capacity: give one

// -----

func.func @a2a_tokens_rows(%sr: tensor<2x2xi32>) {
  %tr, %st, %c = ccl.a2a_tokens %sr over "ep" {chips = 2 : i64} : tensor<2x2xi32> -> tensor<2x3xi32>, tensor<2x4xi32>, tensor<2xi32>
  func.return
}

// CHECK: token_rows must be i32 [2, 2]

// -----

func.func @a2a_token_lists_values(%sr: tensor<4x2xi32>, %v: tensor<3x5xi32>) {
  %l = ccl.a2a_token_lists %sr, %v over "ep" {chips = 2 : i64, slots = 8 : i64} : tensor<4x2xi32>, tensor<3x5xi32> -> tensor<2x4x2xi32>
  func.return
}

// CHECK: values i32[3, 5] are not [4, 2]

// -----

func.func @a2a_token_lists_lists(%sr: tensor<2x2xi32>, %v: tensor<2x2xi32>) {
  %l = ccl.a2a_token_lists %sr, %v over "ep" {chips = 2 : i64, slots = 4 : i64} : tensor<2x2xi32>, tensor<2x2xi32> -> tensor<2x2x3xi32>
  func.return
}

// CHECK: lists must be [2, 2, Kk] with 1 <= Kk <= 2, of the values' type

// -----

func.func @a2a_returns_entries(%sr: tensor<2x2xi32>) {
  %ps, %pc, %tr, %pr, %sc = ccl.a2a_returns %sr over "ep" {chips = 2 : i64, entries = 3 : i64} : tensor<2x2xi32> -> tensor<2x4xi32>, tensor<2xi32>, tensor<2x1xi32>, tensor<2x2xi32>, tensor<2xi32>
  func.return
}

// CHECK: entries must be in [1, 2]

// -----

func.func @a2a_returns_sum_counts(%sr: tensor<2x2xi32>) {
  %ps, %pc, %tr, %pr, %sc = ccl.a2a_returns %sr over "ep" {chips = 2 : i64, entries = 2 : i64, whole_first} : tensor<2x2xi32> -> tensor<2x4xi32>, tensor<2xi32>, tensor<2x1xi32>, tensor<2x2xi32>, tensor<3xi32>
  func.return
}

// CHECK: sum_counts must be i32 [2]

// -----

func.func @a2a_returns_wave(%sr: tensor<2x2xi32>, %e: tensor<2x2xi32>) {
  %ps, %pc, %tr, %pr, %sc = ccl.a2a_returns %sr experts %e over "ep" {chips = 2 : i64, entries = 2 : i64, experts = 4 : i64, local_from = 1 : i64, local_to = 3 : i64} : tensor<2x2xi32>, tensor<2x2xi32> -> tensor<2x4xi32>, tensor<2xi32>, tensor<2x1xi32>, tensor<2x2xi32>, tensor<2xi32>
  func.return
}

// CHECK: local experts [1, 3) are not a range of a chip's 2

// -----

func.func @a2a_returns_wave_experts(%sr: tensor<2x2xi32>) {
  %ps, %pc, %tr, %pr, %sc = ccl.a2a_returns %sr over "ep" {chips = 2 : i64, entries = 2 : i64, local_from = 0 : i64, local_to = 1 : i64} : tensor<2x2xi32> -> tensor<2x4xi32>, tensor<2xi32>, tensor<2x1xi32>, tensor<2x2xi32>, tensor<2xi32>
  func.return
}

// CHECK: a wave needs the pairs' experts, experts, local_from and local_to
