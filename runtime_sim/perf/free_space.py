"""SRAM not held by a live buffer, for the memory plan: how much, and when it may be reused.

Space is counted in bytes (no addresses, hence no fragmentation). A piece of free space
becomes reusable once every command that touched the buffer it held has ended, so each piece
carries those commands (`wait`), and whoever claims it must wait for them too.

Claims take never-used space first, then the piece freed earliest (the smallest last command
to wait for). The pieces sit in a heap on that order, so a claim or a release costs
O(log pieces) rather than a sort of every piece; pieces with the same commands to wait for are
merged into one (nothing tells them apart), so the heap holds one entry per distinct `wait`.
"""

from __future__ import annotations

import heapq


class FreeSpace:
    """Free SRAM bytes, in pieces each reusable once the commands in its `wait` have ended."""

    def __init__(self, capacity: int) -> None:
        self.bytes = 0
        """Free bytes in all, reusable now or later."""
        self._pieces: dict[tuple[int, ...], int] = {}
        """Commands to wait for -> free bytes behind them."""
        self._order: list[tuple[int, tuple[int, ...]]] = []
        """Heap of (the last command to wait for, or -1 for never-used space; the commands)."""
        self.add(capacity, ())

    def add(self, nbytes: int, wait: tuple[int, ...]) -> None:
        """Free `nbytes` that can be reused once every command in `wait` has ended."""
        self.bytes += nbytes
        if wait in self._pieces:
            self._pieces[wait] += nbytes
        else:
            self._pieces[wait] = nbytes
            heapq.heappush(self._order, (max(wait, default=-1), wait))

    def take(self, nbytes: int) -> list[int]:
        """Claim `nbytes` (at most `bytes`), earliest reusable first; returns the commands the
        claimant must wait for. An empty piece in the way is used up too (its commands count)."""
        assert nbytes <= self.bytes, f"claiming {nbytes} of {self.bytes} free bytes"
        self.bytes -= nbytes
        wait: list[int] = []
        while nbytes > 0:
            _, key = self._order[0]
            have = self._pieces[key]
            use = min(nbytes, have)
            wait.extend(key)
            nbytes -= use
            if use == have:
                heapq.heappop(self._order)
                del self._pieces[key]
            else:
                self._pieces[key] = have - use
        return wait
