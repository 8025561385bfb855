// RUN: tcpc-opt %s -p fuse-ve-chains | filecheck %s
// RUN: tcpc-opt %s -p fuse-ve-chains | tcpc-opt | filecheck %s
// RUN: tcpc-opt %s -p fuse-ve-chains --print-op-generic | tcpc-opt | filecheck %s
// RUN: tcpc-opt %s -p fuse-ve-chains,fuse-ve-chains | filecheck %s

// SwiGLU's gate: the widen (the fetch-side cast), sigmoid (Float, FpFpu), a multiply (Float,
// FpMul0) and the cast to bf16 (the Cast Engine after the chain) run as one invocation. The
// multiply reads the widened %y a second time from the stash (taken as the stream enters the
// Tag stage), so %y never reaches SRAM: the chain reads only the bf16 input.
func.func @silu(%y_bf16: tensor<64xbf16>) -> tensor<64xbf16> {
  %y = ve.widen %y_bf16 : tensor<64xbf16> -> tensor<64xf32>
  %s = ve.sigmoid %y : tensor<64xf32>
  %m = ve.mul %y, %s : tensor<64xf32>
  %h = ve.narrow %m : tensor<64xf32> -> tensor<64xbf16>
  func.return %h : tensor<64xbf16>
}

// CHECK-LABEL: func.func @silu
// CHECK-NEXT:  %h = ve.chain (%[[X:.*]] = %y_bf16) : (tensor<64xbf16>) -> tensor<64xbf16> {
// CHECK-NEXT:    %y = ve.widen %[[X]] : tensor<64xbf16> -> tensor<64xf32>
// CHECK-NEXT:    %s = ve.sigmoid %y : tensor<64xf32>
// CHECK-NEXT:    %m = ve.mul %y, %s : tensor<64xf32>
// CHECK-NEXT:    %[[H:.*]] = ve.narrow %m : tensor<64xf32> -> tensor<64xbf16>
// CHECK-NEXT:    ve.yield %[[H]] : tensor<64xbf16>
// CHECK-NEXT:  }
// CHECK-NEXT:  func.return %h : tensor<64xbf16>

// The stash holds one value, read once: a second read of %y ends the chain before it.
func.func @stash_once(%y_bf16: tensor<64xbf16>) -> tensor<64xf32> {
  %y = ve.widen %y_bf16 : tensor<64xbf16> -> tensor<64xf32>
  %s = ve.sigmoid %y : tensor<64xf32>
  %m = ve.mul %y, %s : tensor<64xf32>
  %a = ve.add %m, %y : tensor<64xf32>
  func.return %a : tensor<64xf32>
}

// CHECK-LABEL: func.func @stash_once
// CHECK-NEXT:  %y = ve.widen %y_bf16
// CHECK-NEXT:  %a = ve.chain (%[[Y:.*]] = %y)
// CHECK-NEXT:    %s = ve.sigmoid %[[Y]]
// CHECK-NEXT:    %m = ve.mul %[[Y]], %s
// CHECK-NEXT:    %[[A:.*]] = ve.add %m, %[[Y]]
// CHECK-NEXT:    ve.yield %[[A]]

// Constants ride in the members' immediate slots: they are copied into the chain, and an
// outer one nobody else reads is dropped. The phase goes with the chain.
func.func @bias(%x: tensor<8x4xi32>, %b: tensor<8x4xi32>) -> tensor<8x4xi32> {
  %c = ve.const 3 : tensor<8x4xi32> {tcpc.phase = "routing"}
  %a = ve.mul %x, %c : tensor<8x4xi32> {tcpc.phase = "routing"}
  %s = ve.add %a, %b : tensor<8x4xi32> {tcpc.phase = "routing"}
  %z = ve.max %s, %c : tensor<8x4xi32> {tcpc.phase = "routing"}
  func.return %z : tensor<8x4xi32>
}

// CHECK-LABEL: func.func @bias
// CHECK-NEXT:  %z = ve.chain (%[[X:.*]] = %x, %[[B:.*]] = %b) : (tensor<8x4xi32>, tensor<8x4xi32>) -> tensor<8x4xi32> {
// CHECK-NEXT:    %[[C:.*]] = ve.const 3 : tensor<8x4xi32> {tcpc.phase = "routing"}
// CHECK-NEXT:    %a = ve.mul %[[X]], %[[C]]
// CHECK-NEXT:    %s = ve.add %a, %[[B]]
// CHECK-NEXT:    %[[Z:.*]] = ve.max %s, %[[C]]
// CHECK-NEXT:    ve.yield %[[Z]] : tensor<8x4xi32> {tcpc.phase = "routing"}
// CHECK-NEXT:  } {tcpc.phase = "routing"}
// CHECK-NEXT:  func.return %z
