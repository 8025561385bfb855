// RUN: tcpc-opt %s -p lower-dispatch --verify-diagnostics | filecheck %s
// RUN: tcpc-opt %s -p lower-dispatch --split-input-file --verify-diagnostics | filecheck %s --check-prefix=ARG

// lower-dispatch needs the plan as moe.route: before lower-routing it stops with an error
// instead of rewriting (or crashing on) the ops.

func.func @scatter_left(%x: tensor<4x8xbf16>, %e: tensor<4x1xi32>, %w: tensor<2x8x8xbf16>) -> tensor<3x2x8xbf16> {
  %xb, %route = moe.scatter %x, %e : tensor<4x8xbf16>, tensor<4x1xi32> -> tensor<3x2x8xbf16>, !moe.route<T = 4, K = 1, E = 2, B = 2, G = 3>
  %y = moe.grouped_matmul %xb, %w, %route : tensor<3x2x8xbf16>, tensor<2x8x8xbf16>, !moe.route<T = 4, K = 1, E = 2, B = 2, G = 3> -> tensor<3x2x8xbf16>
  func.return %y : tensor<3x2x8xbf16>
}

// CHECK: lower-dispatch: run lower-routing first: moe.scatter has not been lowered to moe.route and moe.dispatch

// -----

func.func @route_argument(%y: tensor<3x2x8xbf16>, %route: !moe.route<T = 4, K = 1, E = 2, B = 2, G = 3>) -> tensor<4x8xbf16> {
  %out = moe.combine %y, %route : tensor<3x2x8xbf16>, !moe.route<T = 4, K = 1, E = 2, B = 2, G = 3> -> tensor<4x8xbf16>
  func.return %out : tensor<4x8xbf16>
}

// ARG: lower-dispatch: run lower-routing first: %route of moe.combine is not produced by moe.route (it is a block argument)
