// RUN: tcpc-opt %s -p lower-math | filecheck %s

// Casts: widen / narrow between floats; fp_to_fxp (truncate, saturate, NaN to 0) to i32;
// fxp_to_fp from i32, then narrow for bf16 (two roundings, as ml_dtypes does in the reference);
// a cast to the operand's own type disappears; a boolean (a tag stream) selects 1 or 0.

func.func @casts(%h: tensor<8xbf16>, %f: tensor<8xf32>, %i: tensor<8xi32>) -> (tensor<8xf32>, tensor<8xbf16>, tensor<8xi32>, tensor<8xi32>, tensor<8xf32>, tensor<8xbf16>, tensor<8xbf16>) {
  %hf = tmath.cast %h : tensor<8xbf16> -> tensor<8xf32>
  %fh = tmath.cast %f : tensor<8xf32> -> tensor<8xbf16>
  %hi = tmath.cast %h : tensor<8xbf16> -> tensor<8xi32>
  %fi = tmath.cast %f : tensor<8xf32> -> tensor<8xi32>
  %if = tmath.cast %i : tensor<8xi32> -> tensor<8xf32>
  %ih = tmath.cast %i : tensor<8xi32> -> tensor<8xbf16>
  %hh = tmath.cast %h : tensor<8xbf16> -> tensor<8xbf16>
  func.return %hf, %fh, %hi, %fi, %if, %ih, %hh : tensor<8xf32>, tensor<8xbf16>, tensor<8xi32>, tensor<8xi32>, tensor<8xf32>, tensor<8xbf16>, tensor<8xbf16>
}

// CHECK-LABEL: func.func @casts
// CHECK-NEXT:  %hf = ve.widen %h : tensor<8xbf16> -> tensor<8xf32>
// CHECK-NEXT:  %fh = ve.narrow %f : tensor<8xf32> -> tensor<8xbf16>
// CHECK-NEXT:  %[[W:.*]] = ve.widen %h : tensor<8xbf16> -> tensor<8xf32>
// CHECK-NEXT:  %hi = ve.fp_to_fxp %[[W]] : tensor<8xf32> -> tensor<8xi32>
// CHECK-NEXT:  %fi = ve.fp_to_fxp %f : tensor<8xf32> -> tensor<8xi32>
// CHECK-NEXT:  %if = ve.fxp_to_fp %i : tensor<8xi32> -> tensor<8xf32>
// CHECK-NEXT:  %[[F:.*]] = ve.fxp_to_fp %i : tensor<8xi32> -> tensor<8xf32>
// CHECK-NEXT:  %ih = ve.narrow %[[F]] : tensor<8xf32> -> tensor<8xbf16>
// CHECK-NEXT:  func.return %hf, %fh, %hi, %fi, %if, %ih, %h :

func.func @booleans(%a: tensor<8xf32>, %b: tensor<8xf32>) -> (tensor<8xi32>, tensor<8xbf16>) {
  %c = tmath.cmp "lt", %a, %b : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xi1>
  %n = tmath.cast %c : tensor<8xi1> -> tensor<8xi32>
  %h = tmath.cast %c : tensor<8xi1> -> tensor<8xbf16>
  func.return %n, %h : tensor<8xi32>, tensor<8xbf16>
}

// CHECK-LABEL: func.func @booleans
// CHECK-NEXT:  %c = ve.tag lt %a, %b : tensor<8xf32> -> tensor<8xi4>
// CHECK-NEXT:  %[[ONE:.*]] = ve.const 1 : tensor<8xi32>
// CHECK-NEXT:  %[[ZERO:.*]] = ve.const 0 : tensor<8xi32>
// CHECK-NEXT:  %n = ve.select %c in [1], %[[ONE]], %[[ZERO]] : tensor<8xi4>, tensor<8xi32>
// CHECK-NEXT:  %[[FONE:.*]] = ve.const 1.0 : tensor<8xf32>
// CHECK-NEXT:  %[[FZERO:.*]] = ve.const 0.0 : tensor<8xf32>
// CHECK-NEXT:  %[[S:.*]] = ve.select %c in [1], %[[FONE]], %[[FZERO]] : tensor<8xi4>, tensor<8xf32>
// CHECK-NEXT:  %h = ve.narrow %[[S]] : tensor<8xf32> -> tensor<8xbf16>
