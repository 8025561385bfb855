"""The lowerings: the graph-level MoE ops and tensor math down to the engines' ops on whole
tensors (lower-topk, lower-routing, lower-dispatch, lower-quant, lower-math, load-arguments), and
pin-routing, which a cost-only run applies first."""
