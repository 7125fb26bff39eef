"""Paged latent KV cache: a plain-Python page allocator and the per-layer page pools.

Each cached token is one row [c_kv ⊕ k_rope] (kv_lora_rank + rope dim) shared by all heads,
so a page of S tokens costs S·(C+R) elements per layer, whatever the head count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // page_size)


class PageAllocator:
    """Free list over page ids [0, num_pages); each page has one owner at a time."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError("num_pages must be > 0")
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first.
        self._free = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n free pages; raises MemoryError (and takes nothing) if there are fewer."""
        if not self.can_allocate(n):
            raise MemoryError(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages; freeing a page that is not allocated is a bug and raises."""
        bad = [p for p in pages if p not in self._used]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"pages {bad or pages} are not allocated (double free?)")
        self._used.difference_update(pages)
        self._free.extend(reversed(pages))


@dataclass(frozen=True)
class KVCacheConfig:
    """Geometry of the latent cache."""

    num_layers: int
    num_pages: int
    page_size: int
    row_width: int  # kv_lora_rank + qk_rope_head_dim

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_pages", "page_size", "row_width"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")

    def bytes(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return (self.num_pages + 1) * self.page_size * self.row_width * self.num_layers * element


class KVCache:
    """Per-layer page pools [pages + 1, page_size, C + R].

    Page `scratch_page` (the last one) belongs to nobody: padded rows of a CUDA-graph batch
    write there, so the allocator's pages [0, num_pages) are never touched by padding.
    """

    def __init__(self, config: KVCacheConfig, dtype: torch.dtype, device: torch.device | str):
        self.config = config
        self.scratch_page = config.num_pages
        shape = (config.num_layers, config.num_pages + 1, config.page_size, config.row_width)
        self.pools = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, index: int) -> torch.Tensor:
        """The page pool of one layer, [pages + 1, page_size, C + R]."""
        return self.pools[index]
