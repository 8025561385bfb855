// RUN: tcpc-opt %s | filecheck %s
// RUN: tcpc-opt %s --print-op-generic | tcpc-opt | filecheck %s

// Every moe op and the !moe.route type (with a capacity C) in their custom format, printed back unchanged and through the generic format.

func.func @layer(%scores: tensor<8x4xf32>, %x: tensor<8x16xbf16>, %w_gate: tensor<4x16x32xbf16>, %b_gate: tensor<4x32xf32>, %w_down: tensor<4x32x16xbf16>) -> tensor<8x16xbf16> {
  %top_p, %top_e = moe.topk %scores {k = 2 : i64} : tensor<8x4xf32> -> tensor<8x2xf32>, tensor<8x2xi32>
  %by_index, %index_e = moe.topk %scores {k = 2 : i64, order = "index"} : tensor<8x4xf32> -> tensor<8x2xf32>, tensor<8x2xi32>
  %xb, %route = moe.scatter %x, %top_e : tensor<8x16xbf16>, tensor<8x2xi32> -> tensor<10x2x16xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>
  %gate = moe.grouped_matmul %xb, %w_gate, %route bias %b_gate : tensor<10x2x16xbf16>, tensor<4x16x32xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>, tensor<4x32xf32> -> tensor<10x2x32xbf16>
  %yb = moe.grouped_matmul %gate, %w_down, %route : tensor<10x2x32xbf16>, tensor<4x32x16xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10> -> tensor<10x2x16xf32>
  %out = moe.combine %yb, %route weights %top_p : tensor<10x2x16xf32>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>, tensor<8x2xf32> -> tensor<8x16xf32>
  %sum = moe.combine %gate, %route : tensor<10x2x32xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10> -> tensor<8x32xbf16>
  %y = tmath.cast %out : tensor<8x16xf32> -> tensor<8x16xbf16>
  func.return %y : tensor<8x16xbf16>
}
func.func @capacity(%x: tensor<6x16xf32>, %idx: tensor<6x2xi32>) -> tensor<8x2x16xf32> {
  %xb, %route = moe.scatter %x, %idx : tensor<6x16xf32>, tensor<6x2xi32> -> tensor<8x2x16xf32>, !moe.route<T = 6, K = 2, E = 4, B = 2, G = 8, C = 3>
  func.return %xb : tensor<8x2x16xf32>
}
func.func @scaled(%xb: tensor<2x2x256xf8E4M3FN>, %w: tensor<2x256x256xf8E4M3FN>, %xs: tensor<2x2x2xf32>, %ws: tensor<2x2x2xf32>, %b: tensor<2x256xf32>, %si: tensor<2x1xi32>, %ei: tensor<2xi32>) -> tensor<2x2x256xbf16> {
  %route = moe.route %si, %ei : tensor<2x1xi32>, tensor<2xi32> -> !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2>
  %y = moe.scaled_grouped_matmul %xb, %w, %route scales %xs, %ws bias %b : tensor<2x2x256xf8E4M3FN>, tensor<2x256x256xf8E4M3FN>, !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2>, tensor<2x2x2xf32>, tensor<2x2x2xf32>, tensor<2x256xf32> -> tensor<2x2x256xbf16>
  func.return %y : tensor<2x2x256xbf16>
}
func.func @dispatch(%x: tensor<2x4xbf16>, %si: tensor<2x1xi32>, %ei: tensor<2xi32>) -> tensor<2x2x4xbf16> {
  %route = moe.route %si, %ei : tensor<2x1xi32>, tensor<2xi32> -> !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2>
  %xb = moe.dispatch %x, %route : tensor<2x4xbf16>, !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2> -> tensor<2x2x4xbf16>
  func.return %xb : tensor<2x2x4xbf16>
}

func.func @pair_rows(%r: !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>) -> tensor<8x2xi32> {
  %rows = moe.pair_rows %r : !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10> -> tensor<8x2xi32>
  func.return %rows : tensor<8x2xi32>
}

// CHECK:      func.func @layer(%scores: tensor<8x4xf32>, %x: tensor<8x16xbf16>, %w_gate: tensor<4x16x32xbf16>, %b_gate: tensor<4x32xf32>, %w_down: tensor<4x32x16xbf16>) -> tensor<8x16xbf16> {
// CHECK-NEXT:   %top_p, %top_e = moe.topk %scores {k = 2 : i64} : tensor<8x4xf32> -> tensor<8x2xf32>, tensor<8x2xi32>
// CHECK-NEXT:   %by_index, %index_e = moe.topk %scores {k = 2 : i64, order = "index"} : tensor<8x4xf32> -> tensor<8x2xf32>, tensor<8x2xi32>
// CHECK-NEXT:   %xb, %route = moe.scatter %x, %top_e : tensor<8x16xbf16>, tensor<8x2xi32> -> tensor<10x2x16xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>
// CHECK-NEXT:   %gate = moe.grouped_matmul %xb, %w_gate, %route bias %b_gate : tensor<10x2x16xbf16>, tensor<4x16x32xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>, tensor<4x32xf32> -> tensor<10x2x32xbf16>
// CHECK-NEXT:   %yb = moe.grouped_matmul %gate, %w_down, %route : tensor<10x2x32xbf16>, tensor<4x32x16xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10> -> tensor<10x2x16xf32>
// CHECK-NEXT:   %out = moe.combine %yb, %route weights %top_p : tensor<10x2x16xf32>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>, tensor<8x2xf32> -> tensor<8x16xf32>
// CHECK-NEXT:   %sum = moe.combine %gate, %route : tensor<10x2x32xbf16>, !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10> -> tensor<8x32xbf16>
// CHECK-NEXT:   %y = tmath.cast %out : tensor<8x16xf32> -> tensor<8x16xbf16>
// CHECK-NEXT:   func.return %y : tensor<8x16xbf16>
// CHECK-NEXT: }
// CHECK:      func.func @capacity(%x: tensor<6x16xf32>, %idx: tensor<6x2xi32>) -> tensor<8x2x16xf32> {
// CHECK-NEXT:   %xb, %route = moe.scatter %x, %idx : tensor<6x16xf32>, tensor<6x2xi32> -> tensor<8x2x16xf32>, !moe.route<T = 6, K = 2, E = 4, B = 2, G = 8, C = 3>
// CHECK-NEXT:   func.return %xb : tensor<8x2x16xf32>
// CHECK-NEXT: }
// CHECK:      func.func @scaled(%xb: tensor<2x2x256xf8E4M3FN>, %w: tensor<2x256x256xf8E4M3FN>, %xs: tensor<2x2x2xf32>, %ws: tensor<2x2x2xf32>, %b: tensor<2x256xf32>, %si: tensor<2x1xi32>, %ei: tensor<2xi32>) -> tensor<2x2x256xbf16> {
// CHECK-NEXT:   %route = moe.route %si, %ei : tensor<2x1xi32>, tensor<2xi32> -> !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2>
// CHECK-NEXT:   %y = moe.scaled_grouped_matmul %xb, %w, %route scales %xs, %ws bias %b : tensor<2x2x256xf8E4M3FN>, tensor<2x256x256xf8E4M3FN>, !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2>, tensor<2x2x2xf32>, tensor<2x2x2xf32>, tensor<2x256xf32> -> tensor<2x2x256xbf16>
// CHECK-NEXT:   func.return %y : tensor<2x2x256xbf16>
// CHECK-NEXT: }
// CHECK:      func.func @dispatch(%x: tensor<2x4xbf16>, %si: tensor<2x1xi32>, %ei: tensor<2xi32>) -> tensor<2x2x4xbf16> {
// CHECK-NEXT:   %route = moe.route %si, %ei : tensor<2x1xi32>, tensor<2xi32> -> !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2>
// CHECK-NEXT:   %xb = moe.dispatch %x, %route : tensor<2x4xbf16>, !moe.route<T = 2, K = 1, E = 2, B = 2, G = 2> -> tensor<2x2x4xbf16>
// CHECK-NEXT:   func.return %xb : tensor<2x2x4xbf16>
// CHECK-NEXT: }
// CHECK:      func.func @pair_rows(%r: !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10>) -> tensor<8x2xi32> {
// CHECK-NEXT:   %rows = moe.pair_rows %r : !moe.route<T = 8, K = 2, E = 4, B = 2, G = 10> -> tensor<8x2xi32>
// CHECK-NEXT:   func.return %rows : tensor<8x2xi32>
// CHECK-NEXT: }
