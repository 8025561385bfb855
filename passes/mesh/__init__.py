"""Several chips: the graph sharded over a mesh (shard-experts), before the lowering."""
