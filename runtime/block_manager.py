"""The fixed KV-block pool as plain bookkeeping (no torch): a free list, per-sequence block tables, and the
prefix cache.

Prefix caching (automatic, as vLLM's and SGLang's): a block whose `block_size` tokens all have their KV in the
pool is registered under a hash of those tokens chained to the hash of every block before it, i.e. under the
whole token prefix up to its end. A new sequence whose prompt starts with registered blocks takes them by
reference and starts computing after them. A block is never written once it is full, so sharing is read-only;
blocks are reference-counted, and a registered block that no sequence holds any more stays in the pool with its
KV until an allocation needs the room (least recently freed first; blocks that were never registered go first).
Under context parallelism a block id is global (block b lives on CP rank b % cp), so the same bookkeeping serves
every layout.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

from .sequence import Sequence


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold the KV of `tokens` tokens."""
    return -(-tokens // block_size)


def chain_hash(parent: bytes, tokens) -> bytes:
    """A full block's key: sha256 over its parent's key and its token ids (collision-resistant: a false hit would
    silently attend to another prompt's KV)."""
    h = hashlib.sha256(parent)
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


ROOT = b"deepinfer-prefix-v1"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.free_blocks: deque[int] = deque(range(num_blocks))   # holding nothing reusable
        self.refs: dict[int, int] = {}                            # block -> sequences holding it
        self.cached: dict[bytes, int] = {}                        # prefix key -> block with that prefix's KV
        self.key_of: dict[int, bytes] = {}                        # registered block -> its key
        self.evictable: OrderedDict[int, None] = OrderedDict()    # registered, held by no one: LRU first
        self.evictions = 0      # cached prefixes dropped so far (a sequence's memoised match is valid until one)
        self.queries = 0        # prompt tokens looked up in the cache (at admission)
        self.hits = 0           # of which found there

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: empty ones and cached ones no sequence holds."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Registered blocks (held or not): the prefix cache's size."""
        return len(self.key_of)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so that the KV of `num_new_tokens` more tokens fits."""
        return max(0, blocks_for(seq.num_computed + num_new_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        n = self.blocks_needed(seq, num_new_tokens)
        assert n <= self.num_free, "allocate() without can_allocate()"
        for _ in range(n):
            if self.free_blocks:
                b = self.free_blocks.popleft()
            else:                                   # evict the least recently freed cached block
                b, _ = self.evictable.popitem(last=False)
                del self.cached[self.key_of.pop(b)]
                self.evictions += 1
            self.refs[b] = 1
            seq.block_table.append(b)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Its registered blocks stay cached (its last blocks are evicted
        first: later blocks are the least likely to be shared); the rest are free again."""
        for b in reversed(seq.block_table):
            n = self.refs.get(b, 0)
            assert n > 0, f"block {b} freed by a sequence that does not hold it"
            if n > 1:
                self.refs[b] = n - 1
                continue
            del self.refs[b]
            if b in self.key_of:
                self.evictable[b] = None
            else:
                self.free_blocks.appendleft(b)
        seq.block_table.clear()
        seq.num_registered = 0

    # -- the prefix cache ---------------------------------------------------------------------------
    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks a sequence without blocks could start from: the longest run of its leading full
        blocks that are registered, leaving at least its last token to compute (its logits are wanted)."""
        if not self.prefix_caching:
            return []
        # The scheduler asks for every waiting sequence at every step: the last answer is kept on the sequence and
        # only extended while no cached prefix was dropped (a registered key keeps its block until evicted).
        memo = seq.cache_match
        out = memo[1] if memo is not None and memo[0] == self.evictions else []
        limit = (seq.num_tokens - 1) // self.block_size
        del out[limit:]
        while len(out) < limit:                  # keys computed only up to the first miss
            b = self.cached.get(seq.block_key(self.block_size, len(out)))
            if b is None:
                break
            out.append(b)
        seq.cache_match = (self.evictions, out)
        return list(out)

    def take(self, seq: Sequence, blocks: list[int]) -> None:
        """Give a sequence without blocks the cached prefix `blocks` (from match()): its KV counts as computed."""
        assert not seq.block_table and seq.num_computed == 0
        for b in blocks:
            n = self.refs.get(b, 0)
            if n == 0:
                del self.evictable[b]
            self.refs[b] = n + 1
        seq.block_table.extend(blocks)
        seq.num_computed = len(blocks) * self.block_size
        seq.num_registered = len(blocks)
        if seq.num_preemptions == 0:      # what the request's usage reports: its prompt's first admission
            seq.num_cached_tokens = len(blocks) * self.block_size

    def register(self, seq: Sequence) -> None:
        """After a step: register the sequence's blocks that became full of computed KV. A block whose prefix
        another block already holds stays private (and free once the sequence ends)."""
        if not self.prefix_caching or not seq.block_table:
            return
        full = seq.num_computed // self.block_size
        if full <= seq.num_registered:
            return
        for i in range(seq.num_registered, full):
            b, key = seq.block_table[i], seq.block_key(self.block_size, i)
            if key not in self.cached and b not in self.key_of:
                self.cached[key] = b
                self.key_of[b] = key
        seq.num_registered = full

    def reset_cache(self) -> int:
        """Forget every cached prefix no sequence holds (their blocks become plain free blocks); returns how many."""
        n = len(self.evictable)
        for b in self.evictable:
            del self.cached[self.key_of.pop(b)]
            self.free_blocks.append(b)
        self.evictable.clear()
        self.evictions += n
        return n

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size
