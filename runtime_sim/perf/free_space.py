"""SRAM not held by a live buffer, for the memory plan: how much, and when it may be reused.

Space is counted in bytes (no addresses, hence no fragmentation). A piece of free space
becomes reusable once every command that touched the buffer it held has ended, so each piece
carries those commands (`wait`), and whoever claims it must wait for them too.

SRAM is the clusters' data memories, and a cluster's engines fetch from and commit to their
own only (furiosa-opt book, Fetch Engine and Commit Engine: each slice reads and writes its
own DM partition; data between clusters moves by DMA). So the space is one pool per cluster
(capacity / clusters each), and a claim for a buffer of cluster c takes c's space only: its
never-used space first, then its piece freed earliest (the smallest last command to wait
for). Pieces sit in a heap per (cluster, never used) on that order, so a claim or a release
costs O(log pieces); pieces of one heap with the same commands to wait for are merged into
one (nothing tells them apart), so a heap holds one entry per distinct `wait`.
"""

from __future__ import annotations

import heapq


class FreeSpace:
    """Free SRAM bytes of each cluster, in pieces each reusable once the commands in its
    `wait` have ended."""

    def __init__(self, capacity: int, clusters: int = 1) -> None:
        self.clusters = clusters
        self.free = [capacity // clusters + (1 if c < capacity % clusters else 0) for c in range(clusters)]
        """Cluster -> its free bytes, reusable now or later."""
        self._pieces: dict[tuple[int, tuple[int, ...]], int] = {}
        """(heap, commands to wait for) -> free bytes behind them."""
        self._order: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        """Heap -> (the last command to wait for, or -1 for never-used space; the commands).
        Heap 2c holds cluster c's never-used space, 2c + 1 its freed pieces."""
        for c, share in enumerate(self.free):
            self._add(2 * c, share, ())

    @property
    def bytes(self) -> int:
        """Free bytes in all, every cluster's."""
        return sum(self.free)

    def _add(self, heap: int, nbytes: int, wait: tuple[int, ...]) -> None:
        key = (heap, wait)
        if key in self._pieces:
            self._pieces[key] += nbytes
        else:
            self._pieces[key] = nbytes
            heapq.heappush(self._order.setdefault(heap, []), (max(wait, default=-1), wait))

    def add(self, nbytes: int, wait: tuple[int, ...], cluster: int = 0) -> None:
        """Free `nbytes` of `cluster`'s SRAM, held by one of its buffers, that can be reused
        once every command in `wait` has ended."""
        cluster %= self.clusters
        self.free[cluster] += nbytes
        self._add(2 * cluster + 1, nbytes, wait)

    def take(self, nbytes: int, cluster: int = 0) -> list[int]:
        """Claim `nbytes` (at most `free[cluster]`) of `cluster`'s SRAM, never-used space
        first, then the pieces freed earliest; returns the commands the claimant must wait
        for. An empty piece in the way is used up too (its commands count)."""
        cluster %= self.clusters
        assert nbytes <= self.free[cluster], f"claiming {nbytes} of {self.free[cluster]} free bytes"
        self.free[cluster] -= nbytes
        wait: list[int] = []
        never_used = 2 * cluster
        while nbytes > 0:
            source = never_used if self._order.get(never_used) else never_used + 1
            heap = self._order[source]
            _, commands = heap[0]
            key = (source, commands)
            have = self._pieces[key]
            use = min(nbytes, have)
            wait.extend(commands)
            nbytes -= use
            if use == have:
                heapq.heappop(heap)
                del self._pieces[key]
            else:
                self._pieces[key] = have - use
        return wait
