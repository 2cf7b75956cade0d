"""Decode providers: one query token per sequence against a K/V cache, contiguous or paged.

Same interface as the providers in ``providers.py`` (``load``, ``setup``, ``context``, ``prepare``,
``run``, ``canonical``). ``prepare`` builds everything in the provider's own form before timing: a
paged copy of the cache with a shuffled page table, or SDPA's [B, H, S, D] copies.
"""

from __future__ import annotations

from .checking import DecodeCase
from .providers import Prepared, Provider, Sdpa, Unavailable, first


class TriflashKVCache(Provider):
    """``triflash.flash_attn_with_kvcache``: q [B, 1, Hq, D]; contiguous cache [B, S, Hkv, D] or
    paged cache [num_pages, page_size, Hkv, D] with block_table [B, pages] int32; cache_seqlens [B]."""

    def __init__(self, paged: bool):
        self.paged = paged
        self.name = "triflash-paged" if paged else "triflash"
        self.description = ("triflash.flash_attn_with_kvcache, "
                            + ("paged cache (page size 16, shuffled pages)" if paged else "contiguous cache"))

    def load(self):
        import triflash

        self.fn = getattr(triflash, "flash_attn_with_kvcache", None)
        if self.fn is None:
            raise Unavailable("triflash.flash_attn_with_kvcache does not exist yet")

    def prepare(self, case: DecodeCase, requires_grad: bool = False) -> Prepared:
        if not self.paged:
            return Prepared((case.q, case.k_cache, case.v_cache, case.cache_seqlens, None))
        cache = case.paged()
        return Prepared((case.q, cache.k_pages, cache.v_pages, case.cache_seqlens, cache.block_table))

    def run(self, q, k_cache, v_cache, cache_seqlens, block_table):
        return first(self.fn(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                             num_splits=0))

    def canonical(self, t, wl):
        return t


class SdpaDecode(Provider):
    """PyTorch SDPA with one backend forced, on a contiguous [B, H, context, D] copy of the cache;
    GQA through ``enable_gqa`` (no repeated K/V, so it reads the same bytes as the others)."""

    def __init__(self, backend: str):
        self.sdpa = Sdpa(backend)
        self.name = self.sdpa.name
        self.description = self.sdpa.description + ", contiguous cache"

    def load(self):
        self.sdpa.load()

    def setup(self, wl, device):
        self.sdpa.setup(wl, device)

    def context(self):
        return self.sdpa.context()

    def prepare(self, case: DecodeCase, requires_grad: bool = False) -> Prepared:
        context = case.context
        q = case.q.transpose(1, 2).contiguous()                                  # [B, Hq, 1, D]
        k, v = (c[:, :context].transpose(1, 2).contiguous() for c in (case.k_cache, case.v_cache))
        return Prepared((q, k, v, False))

    def run(self, q, k, v, causal):
        return self.sdpa.run(q, k, v, causal)

    def canonical(self, t, wl):
        return t.transpose(1, 2)


class FlashAttn4Decode(Provider):
    """FlashAttention 4 (``flash_attn.cute.flash_attn_varlen_func``) with ``seqused_k``: contiguous
    cache [B, S, Hkv, D], or paged with ``page_table``. num_splits=0 lets it choose split-KV."""

    def __init__(self, paged: bool):
        self.paged = paged
        self.name = "fa4-paged" if paged else "fa4"
        self.description = ("flash_attn.cute.flash_attn_varlen_func, "
                            + ("paged cache (page_table)" if paged else "contiguous cache"))

    def load(self):
        from flash_attn.cute import flash_attn_varlen_func

        self.fn = flash_attn_varlen_func

    def prepare(self, case: DecodeCase, requires_grad: bool = False) -> Prepared:
        if not self.paged:
            return Prepared((case.q, case.k_cache, case.v_cache, case.cache_seqlens, None))
        cache = case.paged()
        return Prepared((case.q, cache.k_pages, cache.v_pages, case.cache_seqlens, cache.block_table))

    def run(self, q, k, v, seqused_k, page_table):
        return first(self.fn(q, k, v, seqused_k=seqused_k, page_table=page_table, num_splits=0))

    def canonical(self, t, wl):
        return t


def decode_providers() -> list[Provider]:
    """Every decode provider, in the order of the tables."""
    return [TriflashKVCache(paged=False), TriflashKVCache(paged=True),
            *(SdpaDecode(b) for b in Sdpa.BACKENDS), FlashAttn4Decode(paged=False),
            FlashAttn4Decode(paged=True)]

