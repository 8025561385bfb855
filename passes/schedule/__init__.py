"""The schedule level: static loops over blocks and token tiles that fit the target's SRAM,
prefetched DMA, the work spread over the clusters, vector-engine chains fused."""
