"""The fixed KV-block pool as plain bookkeeping: a free list and per-sequence block tables (no torch)."""

from __future__ import annotations

from collections import deque

from .sequence import Sequence


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold the KV of `tokens` tokens."""
    return -(-tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.owner: dict[int, int] = {}     # block -> seq_id

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so that the KV of `num_new_tokens` more tokens fits."""
        return max(0, blocks_for(seq.num_computed + num_new_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        n = self.blocks_needed(seq, num_new_tokens)
        assert n <= len(self.free_blocks), "allocate() without can_allocate()"
        for _ in range(n):
            b = self.free_blocks.popleft()
            self.owner[b] = seq.seq_id
            seq.block_table.append(b)

    def free(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            assert self.owner.pop(b) == seq.seq_id, f"block {b} freed by a sequence that does not own it"
            self.free_blocks.appendleft(b)
        seq.block_table.clear()

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size
