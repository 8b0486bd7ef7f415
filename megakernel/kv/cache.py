"""Paged KV storage.

Layers are grouped by attention window: all full-attention layers form one group, all sliding layers (one window)
another. A group owns one pool of blocks; a block holds `block_size` tokens of K and V for *every* layer of its
group, so a sequence needs one block table per group (not per layer). Storage of group g:

    kv[g]: [layers_in_group, num_blocks, 2 (K, V), block_size, kv_heads, head_dim]

so one (layer, block, K|V) tile is a contiguous [block_size, kv_heads, head_dim] slab a kernel can bulk-copy.
Sliding groups recycle blocks that fall out of the window, which bounds their memory per sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megakernel.config import ModelConfig


@dataclass(frozen=True)
class KVGroup:
    name: str                  # "full" or "sliding"
    window: int | None         # keys a query sees (itself included); None = unbounded
    layers: tuple[int, ...]    # model layer indices in this group, in order


@dataclass(frozen=True)
class KVLayout:
    block_size: int
    groups: tuple[KVGroup, ...]
    num_kv_heads: int
    head_dim: int

    @classmethod
    def for_model(cls, cfg: ModelConfig, block_size: int = 64) -> "KVLayout":
        full = tuple(i for i in range(cfg.num_layers) if cfg.window_for(i) is None)
        sliding = tuple(i for i in range(cfg.num_layers) if cfg.window_for(i) is not None)
        groups = []
        if full:
            groups.append(KVGroup("full", None, full))
        if sliding:
            groups.append(KVGroup("sliding", cfg.sliding_window, sliding))
        return cls(block_size, tuple(groups), cfg.num_kv_heads, cfg.head_dim)

    def locate(self, layer: int) -> tuple[int, int]:
        """(group index, index of the layer inside its group)."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise KeyError(layer)

    def block_bytes(self, g: int, dtype: torch.dtype) -> int:
        elt = torch.empty((), dtype=dtype).element_size()
        return len(self.groups[g].layers) * 2 * self.block_size * self.num_kv_heads * self.head_dim * elt

    def blocks_per_seq(self, g: int, num_tokens: int, chunk: int) -> int:
        """Most blocks one sequence of `num_tokens` can hold at once in group g, prefilling in `chunk` pieces."""
        w = self.groups[g].window
        live = num_tokens if w is None else min(num_tokens, w - 1 + chunk)
        return math.ceil(live / self.block_size) + (0 if w is None else 1)


class KVCache:
    """The device tensors of every group, and per-layer views into them."""

    def __init__(self, layout: KVLayout, num_blocks: list[int], device: torch.device | str,
                 dtype: torch.dtype) -> None:
        self.layout = layout
        self.num_blocks = list(num_blocks)
        self.dtype = dtype
        self.kv = [
            torch.zeros(len(g.layers), n, 2, layout.block_size, layout.num_kv_heads, layout.head_dim,
                        device=device, dtype=dtype)
            for g, n in zip(layout.groups, num_blocks)
        ]
        self._where = {layer: layout.locate(layer) for g in layout.groups for layer in g.layers}

    def layer(self, layer: int) -> tuple[int, torch.Tensor]:
        """(group index, this layer's storage [num_blocks, 2, block_size, kv_heads, head_dim])."""
        g, j = self._where[layer]
        return g, self.kv[g][j]

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)


def plan_num_blocks(layout: KVLayout, budget_bytes: int, dtype: torch.dtype, max_num_seqs: int,
                    max_model_len: int, chunk: int) -> list[int]:
    """Split a memory budget between the groups.

    A sliding group never needs more than a window per sequence: it gets that first (`max_num_seqs` windows,
    scaled down only if the budget cannot hold them), and the full-attention group takes the rest, up to twice
    what `max_num_seqs` sequences of `max_model_len` tokens need (the second half keeps cached prefixes).
    """
    n_groups = len(layout.groups)
    sizes = [layout.block_bytes(g, dtype) for g in range(n_groups)]
    bounded = [g for g in range(n_groups) if layout.groups[g].window is not None]
    unbounded = [g for g in range(n_groups) if layout.groups[g].window is None]
    out = [0] * n_groups
    want = {g: max_num_seqs * layout.blocks_per_seq(g, max_model_len, chunk) for g in bounded}
    want_bytes = sum(want[g] * sizes[g] for g in bounded)
    share = budget_bytes / 2 if unbounded else budget_bytes    # leave room for full layers if windows don't fit
    scale = min(1.0, share / want_bytes) if want_bytes else 1.0
    for g in bounded:
        out[g] = max(1, int(want[g] * scale))
    rest = budget_bytes - sum(out[g] * sizes[g] for g in bounded)
    for g in unbounded:
        cap = 2 * max_num_seqs * layout.blocks_per_seq(g, max_model_len, chunk)
        out[g] = max(1, min(cap, rest // (sizes[g] * len(unbounded))))
    return out


def max_seq_len(layout: KVLayout, num_blocks: list[int], chunk: int) -> int:
    """The longest sequence the pools can hold alone: every full-attention token, and a sliding group's window
    plus one prefill chunk (fewer blocks than that cap the sequence at what they cover)."""
    bs = layout.block_size
    cap = None
    for group, n in zip(layout.groups, num_blocks):
        if group.window is None:
            limit = n * bs
        elif n < math.ceil((group.window - 1 + chunk) / bs) + 1:
            limit = max(0, (n - 1) * bs)
        else:
            continue
        cap = limit if cap is None else min(cap, limit)
    return cap if cap is not None else 1 << 62
