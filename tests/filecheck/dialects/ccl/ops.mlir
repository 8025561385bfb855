// RUN: tcpc-opt %s | filecheck %s
// RUN: tcpc-opt %s --print-op-generic | tcpc-opt | filecheck %s

// Every ccl op, and the ccl.shard, ccl.tp_axis, ccl.mesh and ccl.strategy attributes, in their custom format, printed back unchanged and through the generic format.

func.func @exchange(%x: tensor<2x8xbf16> {ccl.shard = "tokens"}, %w_up: tensor<2x8x8xbf16> {ccl.shard = "experts", ccl.tp_axis = 2 : i64}, %top_e: tensor<2x2xi32>, %partial: tensor<4x8xf32>, %rows: tensor<2x4x8xf32>) -> tensor<2x4x8xf32> attributes {ccl.mesh = "ep=2,tp=2", ccl.strategy = "a2a"} {
  %slot_rows, %slot_experts, %send_counts = ccl.a2a_plan %top_e over "ep" {chips = 2 : i64, experts = 4 : i64, capacity = 0 : i64} : tensor<2x2xi32> -> tensor<2x2xi32>, tensor<2x4xi32>, tensor<2xi32>
  %token_rows, %slot_tokens, %token_counts = ccl.a2a_tokens %slot_rows over "ep" {chips = 2 : i64} : tensor<2x2xi32> -> tensor<2x2xi32>, tensor<2x4xi32>, tensor<2xi32>
  %expert_lists = ccl.a2a_token_lists %slot_rows, %top_e over "ep" {chips = 2 : i64, slots = 4 : i64, whole_first} : tensor<2x2xi32>, tensor<2x2xi32> -> tensor<2x2x2xi32>
  %pair_slots, %pair_counts, %token_returns, %pair_returns, %sum_counts = ccl.a2a_returns %slot_rows over "ep" {chips = 2 : i64, entries = 2 : i64, whole_first} : tensor<2x2xi32> -> tensor<2x4xi32>, tensor<2xi32>, tensor<2x1xi32>, tensor<2x2xi32>, tensor<2xi32>
  %pair_slots0, %pair_counts0, %token_returns0, %pair_returns0, %sum_counts0 = ccl.a2a_returns %slot_rows experts %top_e over "ep" {chips = 2 : i64, entries = 2 : i64, whole_first, experts = 4 : i64, local_from = 0 : i64, local_to = 1 : i64} : tensor<2x2xi32>, tensor<2x2xi32> -> tensor<2x4xi32>, tensor<2xi32>, tensor<2x1xi32>, tensor<2x2xi32>, tensor<2xi32>
  %recv_counts = ccl.all_to_all %send_counts over "ep" {chips = 2 : i64} : tensor<2xi32> -> tensor<2xi32>
  %lists = ccl.all_to_all %expert_lists rows %token_counts over "ep" {chips = 2 : i64} : tensor<2x2x2xi32>, tensor<2xi32> -> tensor<2x2x2xi32>
  %x_all = ccl.all_gather %x over "ep" {chips = 2 : i64} : tensor<2x8xbf16> -> tensor<4x8xbf16>
  %chip = ccl.chip_id over "ep" {chips = 2 : i64} : tensor<i32>
  %summed = ccl.reduce_scatter %partial over "ep" {chips = 2 : i64} : tensor<4x8xf32> -> tensor<2x8xf32>
  %total = ccl.all_reduce %partial over "tp" {chips = 2 : i64} : tensor<4x8xf32> -> tensor<4x8xf32>
  %summed_rows = ccl.all_reduce %rows rows %recv_counts over "tp" {chips = 2 : i64} : tensor<2x4x8xf32>, tensor<2xi32> -> tensor<2x4x8xf32>
  func.return %summed_rows : tensor<2x4x8xf32>
}
func.func @capacity(%top_e: tensor<2x2xi32>, %chip_counts: tensor<2x4xi32>) -> tensor<2x2xi32> {
  %slot_rows, %slot_experts, %send_counts = ccl.a2a_plan %top_e after %chip_counts over "ep" {chips = 2 : i64, experts = 4 : i64, capacity = 1 : i64} : tensor<2x2xi32>, tensor<2x4xi32> -> tensor<2x2xi32>, tensor<2x2xi32>, tensor<2xi32>
  func.return %slot_rows : tensor<2x2xi32>
}
// tp's combine: each tp chip sums its half of the slots' columns, then the outputs' columns are gathered.
func.func @columns(%slots: tensor<2x4x2x4xf32>, %recv_counts: tensor<2xi32>, %own: tensor<2x1x4xbf16>) -> tensor<2x2x4xbf16> {
  %summed = ccl.reduce_scatter %slots rows %recv_counts over "tp" {chips = 2 : i64, dim = 2 : i64} : tensor<2x4x2x4xf32>, tensor<2xi32> -> tensor<2x4x1x4xf32>
  %out = ccl.all_gather %own over "tp" {chips = 2 : i64, dim = 1 : i64} : tensor<2x1x4xbf16> -> tensor<2x2x4xbf16>
  func.return %out : tensor<2x2x4xbf16>
}
// A receiver's sums computed over its received rows packed first go back packed.
func.func @packed(%sums: tensor<2x4x8xbf16>, %counts: tensor<2xi32>) -> tensor<2x4x8xbf16> {
  %back = ccl.all_to_all_start %sums rows %counts over "ep" {chips = 2 : i64, packed} : tensor<2x4x8xbf16>, tensor<2xi32> -> tensor<2x4x8xbf16>
  %back_done = ccl.all_to_all_done %back : tensor<2x4x8xbf16>
  func.return %back_done : tensor<2x4x8xbf16>
}

// CHECK:      func.func @exchange(%x: tensor<2x8xbf16> {ccl.shard = "tokens"}, %w_up: tensor<2x8x8xbf16> {ccl.shard = "experts", ccl.tp_axis = 2 : i64}, %top_e: tensor<2x2xi32>, %partial: tensor<4x8xf32>, %rows: tensor<2x4x8xf32>) -> tensor<2x4x8xf32> attributes {ccl.mesh = "ep=2,tp=2", ccl.strategy = "a2a"} {
// CHECK-NEXT:   %slot_rows, %slot_experts, %send_counts = ccl.a2a_plan %top_e over "ep" {chips = 2 : i64, experts = 4 : i64, capacity = 0 : i64} : tensor<2x2xi32> -> tensor<2x2xi32>, tensor<2x4xi32>, tensor<2xi32>
// CHECK-NEXT:   %token_rows, %slot_tokens, %token_counts = ccl.a2a_tokens %slot_rows over "ep" {chips = 2 : i64} : tensor<2x2xi32> -> tensor<2x2xi32>, tensor<2x4xi32>, tensor<2xi32>
// CHECK-NEXT:   %expert_lists = ccl.a2a_token_lists %slot_rows, %top_e over "ep" {chips = 2 : i64, slots = 4 : i64, whole_first} : tensor<2x2xi32>, tensor<2x2xi32> -> tensor<2x2x2xi32>
// CHECK-NEXT: %pair_slots, %pair_counts, %token_returns, %pair_returns, %sum_counts = ccl.a2a_returns %slot_rows over "ep" {chips = 2 : i64, entries = 2 : i64, whole_first} : tensor<2x2xi32> -> tensor<2x4xi32>, tensor<2xi32>, tensor<2x1xi32>, tensor<2x2xi32>, tensor<2xi32>
// CHECK-NEXT: %pair_slots0, %pair_counts0, %token_returns0, %pair_returns0, %sum_counts0 = ccl.a2a_returns %slot_rows experts %top_e over "ep" {chips = 2 : i64, entries = 2 : i64, whole_first, experts = 4 : i64, local_from = 0 : i64, local_to = 1 : i64} : tensor<2x2xi32>, tensor<2x2xi32> -> tensor<2x4xi32>, tensor<2xi32>, tensor<2x1xi32>, tensor<2x2xi32>, tensor<2xi32>
// CHECK-NEXT:   %recv_counts = ccl.all_to_all %send_counts over "ep" {chips = 2 : i64} : tensor<2xi32> -> tensor<2xi32>
// CHECK-NEXT:   %lists = ccl.all_to_all %expert_lists rows %token_counts over "ep" {chips = 2 : i64} : tensor<2x2x2xi32>, tensor<2xi32> -> tensor<2x2x2xi32>
// CHECK-NEXT:   %x_all = ccl.all_gather %x over "ep" {chips = 2 : i64} : tensor<2x8xbf16> -> tensor<4x8xbf16>
// CHECK-NEXT:   %chip = ccl.chip_id over "ep" {chips = 2 : i64} : tensor<i32>
// CHECK-NEXT:   %summed = ccl.reduce_scatter %partial over "ep" {chips = 2 : i64} : tensor<4x8xf32> -> tensor<2x8xf32>
// CHECK-NEXT:   %total = ccl.all_reduce %partial over "tp" {chips = 2 : i64} : tensor<4x8xf32> -> tensor<4x8xf32>
// CHECK-NEXT:   %summed_rows = ccl.all_reduce %rows rows %recv_counts over "tp" {chips = 2 : i64} : tensor<2x4x8xf32>, tensor<2xi32> -> tensor<2x4x8xf32>
// CHECK-NEXT:   func.return %summed_rows : tensor<2x4x8xf32>
// CHECK-NEXT: }
// CHECK:      func.func @capacity(%top_e: tensor<2x2xi32>, %chip_counts: tensor<2x4xi32>) -> tensor<2x2xi32> {
// CHECK-NEXT:   %slot_rows, %slot_experts, %send_counts = ccl.a2a_plan %top_e after %chip_counts over "ep" {chips = 2 : i64, experts = 4 : i64, capacity = 1 : i64} : tensor<2x2xi32>, tensor<2x4xi32> -> tensor<2x2xi32>, tensor<2x2xi32>, tensor<2xi32>
// CHECK-NEXT:   func.return %slot_rows : tensor<2x2xi32>
// CHECK-NEXT: }
// CHECK:      func.func @columns(%slots: tensor<2x4x2x4xf32>, %recv_counts: tensor<2xi32>, %own: tensor<2x1x4xbf16>) -> tensor<2x2x4xbf16> {
// CHECK-NEXT:   %summed = ccl.reduce_scatter %slots rows %recv_counts over "tp" {chips = 2 : i64, dim = 2 : i64} : tensor<2x4x2x4xf32>, tensor<2xi32> -> tensor<2x4x1x4xf32>
// CHECK-NEXT:   %out = ccl.all_gather %own over "tp" {chips = 2 : i64, dim = 1 : i64} : tensor<2x1x4xbf16> -> tensor<2x2x4xbf16>
// CHECK:      func.func @packed(%sums: tensor<2x4x8xbf16>, %counts: tensor<2xi32>) -> tensor<2x4x8xbf16> {
// CHECK-NEXT:   %back = ccl.all_to_all_start %sums rows %counts over "ep" {chips = 2 : i64, packed} : tensor<2x4x8xbf16>, tensor<2xi32> -> tensor<2x4x8xbf16>
