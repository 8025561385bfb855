"""SRAM not held by a live buffer, for the memory plan: how much, and when it may be reused.

Space is counted in bytes (no addresses, hence no fragmentation). A piece of free space
becomes reusable once every command that touched the buffer it held has ended, so each piece
carries those commands (`wait`), and whoever claims it must wait for them too.

SRAM is the clusters' data memories, so the space starts as one never-used piece per cluster
(capacity / clusters each). A claim for a buffer of cluster c takes c's never-used space first,
then c's piece freed earliest (the smallest last command to wait for), then another cluster's
never-used space, then another cluster's piece freed earliest. (In issue order one cluster's
block of a loop iteration comes before the other's: one pool, taken in issue order, handed the
first cluster all never-used space and then the second cluster's freed space, so each waited
for the other's commands, false dependencies that ran the two clusters in turn.) Pieces sit in
a heap per (cluster, never used) on that order, so a claim or a release costs O(log pieces);
pieces of one heap with the same commands to wait for are merged into one (nothing tells them
apart), so a heap holds one entry per distinct `wait`.
"""

from __future__ import annotations

import heapq


class FreeSpace:
    """Free SRAM bytes, in pieces each reusable once the commands in its `wait` have ended,
    each of one cluster's memory."""

    def __init__(self, capacity: int, clusters: int = 1) -> None:
        self.bytes = 0
        """Free bytes in all, reusable now or later."""
        self._pieces: dict[tuple[int, tuple[int, ...]], int] = {}
        """(heap, commands to wait for) -> free bytes behind them."""
        self._order: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        """Heap -> (the last command to wait for, or -1 for never-used space; the commands).
        Heap 2c holds cluster c's never-used space, 2c + 1 its freed pieces."""
        self.clusters = clusters
        for c in range(clusters):
            share = capacity // clusters + (1 if c < capacity % clusters else 0)
            self._add(2 * c, share, ())

    def _add(self, heap: int, nbytes: int, wait: tuple[int, ...]) -> None:
        self.bytes += nbytes
        key = (heap, wait)
        if key in self._pieces:
            self._pieces[key] += nbytes
        else:
            self._pieces[key] = nbytes
            heapq.heappush(self._order.setdefault(heap, []), (max(wait, default=-1), wait))

    def add(self, nbytes: int, wait: tuple[int, ...], cluster: int = 0) -> None:
        """Free `nbytes`, held by a buffer of `cluster`, that can be reused once every command
        in `wait` has ended."""
        self._add(2 * (cluster % self.clusters) + 1, nbytes, wait)

    def _next_heap(self, cluster: int) -> int:
        """The heap a claim for `cluster` takes from next (module docstring)."""
        own = 2 * (cluster % self.clusters)
        for heap in (own, own + 1):
            if self._order.get(heap):
                return heap
        others = [h for h, pieces in self._order.items() if pieces and h // 2 != own // 2]
        return min(others, key=lambda h: (h % 2, self._order[h][0][0], h))

    def take(self, nbytes: int, cluster: int = 0) -> list[int]:
        """Claim `nbytes` (at most `bytes`) for a buffer of `cluster`, in the module
        docstring's order; returns the commands the claimant must wait for. An empty piece in
        the way is used up too (its commands count)."""
        assert nbytes <= self.bytes, f"claiming {nbytes} of {self.bytes} free bytes"
        self.bytes -= nbytes
        wait: list[int] = []
        while nbytes > 0:
            source = self._next_heap(cluster)
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
