"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Every step carries the decode token of each running sequence plus prefill chunks (of waiting or
partly-prefilled sequences) up to a token budget, so a long prompt never stalls running streams for more than
one chunk. When the KV pool runs dry, the most recently admitted sequence is preempted: its blocks are freed and
it is recomputed later from its tokens, transparently to the caller.

Steps are pipelined (see LLMEngine.step): when schedule() runs, a sequence's last token may still be in flight
(a placeholder the device fills in). Such a sequence decodes normally; one whose in-flight token is its last is
not scheduled again, and a preempted one waits for its token before it is admitted again. A constrained sequence
(structured outputs) is not scheduled while it has a token in flight: its next mask depends on that token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from megakernel.engine.sequence import Sequence, Status
from megakernel.errors import OutOfKVBlocks
from megakernel.kv.block_manager import BlockManager
from megakernel.kv.prefix_cache import PrefixCache


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int           # first position computed this step
    end: int             # one past the last

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's end, so a token is sampled after it."""
        return self.end == len(self.seq)

    @property
    def is_decode(self) -> bool:
        return self.end - self.start == 1 and self.seq.num_computed == len(self.seq) - 1 and \
            self.seq.num_output > 0


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_cache: PrefixCache | None = None, prefill_with_decodes: int | None = None) -> None:
        """`blocks` must evict from `prefix_cache` when a pool runs short (`BlockManager(..., evictor=...)`).
        max_num_batched_tokens: tokens per step; prefill_with_decodes: the smaller budget of a step that also
        carries decode rows (so a long prompt's chunks stall running streams less), None = the same."""
        if prefix_cache is not None and blocks.evictor is not prefix_cache:
            raise ValueError("the block manager must evict from the scheduler's prefix cache: build it with "
                             "BlockManager(layout, num_blocks, evictor=prefix_cache)")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_with_decodes = prefill_with_decodes
        self.prefix_cache = prefix_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.ended: list[Sequence] = []     # sequences the scheduler ended itself (out of KV), for the engine

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        budget = self.max_num_batched_tokens
        if self.prefill_with_decodes is not None:
            n_dec = sum(1 for s in self.running if s.num_pending == 1 and not s.awaiting_last)
            if n_dec:
                budget = min(budget, self.prefill_with_decodes + n_dec)
        # 1. Running sequences, oldest first: decodes and continuing prefills.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            n = min(seq.num_pending, budget) if seq.num_pending > 1 else 1
            if n <= 0 or seq.awaiting_last or (seq.matcher is not None and seq.pending):
                # its last token is in flight (no further step), or it is constrained and its grammar mask
                # needs the token still in flight (it runs again once that token is read back)
                i += 1
                continue
            if not self._try_prepare(seq, n, chunks):
                continue          # seq itself was preempted; the list shrank, i stays
            chunks.append(ScheduledChunk(seq, seq.num_computed, seq.num_computed + n))
            budget -= n
            i += 1
        # 2. Admit waiting sequences while there is room.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.pending:
                break         # preempted with a token still in flight: admit it once the token is read back
            if seq.num_computed == 0 and self.prefix_cache is not None:
                seq.num_computed = self.prefix_cache.attach(seq.token_ids, seq.blocks, self.blocks)
                seq.num_cached_prompt = min(seq.num_computed, seq.num_prompt)
            n = min(seq.num_pending, budget)
            try:
                self.blocks.prepare(seq.blocks, seq.num_computed, seq.num_computed + n)
            except OutOfKVBlocks:
                self.blocks.free(seq.blocks)            # undo a prefix-cache attach
                seq.num_computed = seq.num_cached_prompt = 0
                if not self.running and not chunks:
                    # nothing else holds blocks: this sequence can never fit; end it where it is
                    self.finish(seq, "length")
                    self.ended.append(seq)
                    continue
                break
            if self.prefix_cache is not None and not seq.num_preemptions:
                self.prefix_cache.count(seq.num_prompt, seq.num_cached_prompt)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, seq.num_computed, seq.num_computed + n))
            budget -= n
        return chunks

    def _try_prepare(self, seq: Sequence, n: int, chunks: list[ScheduledChunk]) -> bool:
        """Back seq's next n tokens with blocks, preempting newer sequences until it fits.

        Returns False if `seq` itself had to be preempted (or ended, when it cannot fit even alone).
        """
        while True:
            try:
                self.blocks.prepare(seq.blocks, seq.num_computed, seq.num_computed + n)
                return True
            except OutOfKVBlocks:
                if self.running == [seq]:
                    # it holds every block in use and still cannot grow: end it where it is (once a token still
                    # in flight is read back: that token is valid output)
                    if seq.pending:
                        seq.awaiting_last = seq.kv_capped = True
                        return False
                    self.finish(seq, "length")
                    self.ended.append(seq)
                    return False
                victim = self.running[-1]
                if any(c.seq is victim for c in chunks):
                    # never preempt a sequence already in this step's batch: preempt the one asking instead
                    victim = seq
                self.preempt(victim)
                if victim is seq:
                    return False

    def preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and queue it for recomputation (prompt + tokens generated so far)."""
        self.running.remove(seq)
        self._drop_blocks(seq)
        seq.num_computed = seq.num_cached_prompt = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.drop_pending()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._drop_blocks(seq)

    def _drop_blocks(self, seq: Sequence) -> None:
        """Give seq's blocks back, letting the prefix cache keep the full computed ones first."""
        if self.prefix_cache is not None:
            self.prefix_cache.release(seq.token_ids, seq.blocks, min(seq.num_computed, seq.num_known), self.blocks)
        self.blocks.free(seq.blocks)

    def recycle(self, seq: Sequence) -> None:
        """Free seq's sliding blocks that fell out of the window (the prefix cache may keep them)."""
        keep = None
        if self.prefix_cache is not None:
            pc, blocks = self.prefix_cache, self.blocks
            keep = lambda g, i, b: pc.offer(seq.token_ids, seq.blocks, g, i, b, blocks)  # noqa: E731
        self.blocks.recycle(seq.blocks, seq.num_computed, keep)
