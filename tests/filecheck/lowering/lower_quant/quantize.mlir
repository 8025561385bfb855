// RUN: tcpc-opt %s -p lower-quant | filecheck %s
// RUN: tcpc-opt %s -p lower-quant --print-op-generic | tcpc-opt | filecheck %s

// quantize: per group of 4 along the last axis, in f32 lanes: |x| by clearing the sign bit,
// the group's amax (reduce_max), max(amax, 1e-10) / 448 is the scale, x / scale is narrowed to
// f8e4m3 by the cast engine (saturating, round to nearest even). x is viewed as its groups
// while still bf16 and widened once for each of the two streams that read it (the amax and
// the division), so each widen is the fetch cast of its own chain (fuse-ve-chains,
// tests/filecheck/schedule/fuse_ve_chains/quantize.mlir) and no f32 copy of x reaches SRAM.

func.func @quantize(%x: tensor<2x3x8xbf16>) -> (tensor<2x3x8xf8E4M3FN>, tensor<2x3x2xf32>) {
  %xq, %xs = lowp.quantize %x {group = 4 : i64} : tensor<2x3x8xbf16> -> tensor<2x3x8xf8E4M3FN>, tensor<2x3x2xf32>
  func.return %xq, %xs : tensor<2x3x8xf8E4M3FN>, tensor<2x3x2xf32>
}

// CHECK-LABEL: func.func @quantize
// CHECK-NOT:   lowp.
// CHECK:       %x_groups = tcp.view %x : tensor<2x3x8xbf16> -> tensor<2x3x2x4xbf16>
// CHECK-NEXT:  %x_f32 = ve.widen %x_groups : tensor<2x3x2x4xbf16> -> tensor<2x3x2x4xf32>
// CHECK-NEXT:  %[[BITS:.*]] = ve.bitcast %x_f32 : tensor<2x3x2x4xf32> -> tensor<2x3x2x4xi32>
// CHECK-NEXT:  %[[MASK:.*]] = ve.const 0x7fffffff : tensor<2x3x2x4xi32>
// CHECK-NEXT:  %[[ABS:.*]] = ve.and %[[BITS]], %[[MASK]] : tensor<2x3x2x4xi32>
// CHECK-NEXT:  %x_abs = ve.bitcast %[[ABS]] : tensor<2x3x2x4xi32> -> tensor<2x3x2x4xf32>
// CHECK-NEXT:  %amax = ve.reduce_max %x_abs along 3 : tensor<2x3x2x4xf32> -> tensor<2x3x2xf32>
// CHECK-NEXT:  %[[EPS:.*]] = ve.const 1.{{[0-9]+}}e-10 : tensor<2x3x2xf32>
// CHECK-NEXT:  %amax_floor = ve.max %amax, %[[EPS]] : tensor<2x3x2xf32>
// CHECK-NEXT:  %[[MAX:.*]] = ve.const 448.0 : tensor<2x3x2xf32>
// CHECK-NEXT:  %xs = ve.div %amax_floor, %[[MAX]] : tensor<2x3x2xf32>
// CHECK-NEXT:  %x_f32_again = ve.widen %x_groups : tensor<2x3x2x4xbf16> -> tensor<2x3x2x4xf32>
// CHECK-NEXT:  %[[S:.*]] = ve.broadcast %xs along 3 : tensor<2x3x2xf32> -> tensor<2x3x2x4xf32>
// CHECK-NEXT:  %x_scaled = ve.div %x_f32_again, %[[S]] : tensor<2x3x2x4xf32>
// CHECK-NEXT:  %values_groups = ve.narrow_low %x_scaled : tensor<2x3x2x4xf32> -> tensor<2x3x2x4xf8E4M3FN>
// CHECK-NEXT:  %xq = tcp.view %values_groups : tensor<2x3x2x4xf8E4M3FN> -> tensor<2x3x8xf8E4M3FN>
// CHECK-NEXT:  func.return %xq, %xs
