// RUN: tcpc-opt %s -p lower-math | filecheck %s

// matmul: a tcp.contract whose spec comes from the ranks, rounded once to the result type (the
// contraction engine accumulates in f32). A batch axis of size 1 facing a larger one is left out
// of that operand's side of the spec (a view drops it): the engine reuses the operand.

func.func @router(%x: tensor<16x64xbf16>, %w: tensor<64x8xf32>) -> tensor<16x8xf32> {
  %xf = tmath.cast %x : tensor<16x64xbf16> -> tensor<16x64xf32>
  %l = tmath.matmul %xf, %w : (tensor<16x64xf32>, tensor<64x8xf32>) -> tensor<16x8xf32>
  func.return %l : tensor<16x8xf32>
}

// CHECK-LABEL: func.func @router
// CHECK-NEXT:  %xf = ve.widen %x : tensor<16x64xbf16> -> tensor<16x64xf32>
// CHECK-NEXT:  %l = tcp.contract "mk,kn->mn" %xf, %w : tensor<16x64xf32>, tensor<64x8xf32> -> tensor<16x8xf32>
// CHECK-NEXT:  func.return %l : tensor<16x8xf32>

func.func @bf16(%x: tensor<16x64xbf16>, %w: tensor<64x32xbf16>) -> tensor<16x32xbf16> {
  %y = tmath.matmul %x, %w : (tensor<16x64xbf16>, tensor<64x32xbf16>) -> tensor<16x32xbf16>
  func.return %y : tensor<16x32xbf16>
}

// CHECK-LABEL: func.func @bf16
// CHECK-NEXT:  %y = tcp.contract "mk,kn->mn" %x, %w : tensor<16x64xbf16>, tensor<64x32xbf16> -> tensor<16x32xbf16>

func.func @batched(%a: tensor<2x1x3x4xbf16>, %b: tensor<5x4x6xbf16>) -> tensor<2x5x3x6xbf16> {
  %y = tmath.matmul %a, %b : (tensor<2x1x3x4xbf16>, tensor<5x4x6xbf16>) -> tensor<2x5x3x6xbf16>
  func.return %y : tensor<2x5x3x6xbf16>
}

// CHECK-LABEL: func.func @batched
// CHECK-NEXT:  %[[A:.*]] = tcp.view %a : tensor<2x1x3x4xbf16> -> tensor<2x3x4xbf16>
// CHECK-NEXT:  %y = tcp.contract "amk,bkn->abmn" %[[A]], %b : tensor<2x3x4xbf16>, tensor<5x4x6xbf16> -> tensor<2x5x3x6xbf16>
