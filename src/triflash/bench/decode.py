"""Decode providers: one query token per sequence against a K/V cache, contiguous or paged.

Same interface as the providers in ``providers.py`` (``load``, ``setup``, ``context``, ``prepare``,
``run``, ``canonical``). ``prepare`` builds everything in the provider's own form before timing: a
paged copy of the cache with a shuffled page table, or SDPA's [B, H, S, D] copies.
"""

from __future__ import annotations

import torch

from .checking import DecodeCase
from .providers import TRIFLASH_VARIANTS, FlashAttn4, Prepared, Provider, Sdpa, fa4_variant_checks, first


class _CacheProvider(Provider):
    """A decode call on the case's own cache: contiguous [B, S, Hkv, D], or a paged copy (page size
    16, shuffled pages). ``run`` gets (q, k_cache, v_cache, cache_seqlens, block_table or None)."""

    def __init__(self, paged: bool, name: str, description: str):
        self.paged = paged
        self.name = f"{name}-paged" if paged else name
        self.description = description + (", paged cache (page size 16, shuffled pages)" if paged
                                          else ", contiguous cache")

    def prepare(self, case: DecodeCase, requires_grad: bool = False) -> Prepared:
        self.take_keywords(case)
        return Prepared(case.args(self.paged))


class TriflashKVCache(_CacheProvider):
    """``triflash.flash_attn_with_kvcache``: q [B, 1, Hq, D], cache_seqlens [B], block_table [B, pages]
    int32 when paged; the split count is the library's own choice. Takes the score variants and a
    window."""

    VARIANTS = TRIFLASH_VARIANTS
    windows = True

    def __init__(self, paged: bool):
        super().__init__(paged, "triflash", "triflash.flash_attn_with_kvcache")

    def load(self):
        import triflash

        self.fn = triflash.flash_attn_with_kvcache

    def run(self, q, k_cache, v_cache, cache_seqlens, block_table):
        return first(self.fn(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                             num_splits=0, **self.call_kwargs))


class SdpaDecode(Sdpa):
    """PyTorch SDPA with one backend forced, on a contiguous [B, H, context, D] copy of the cache;
    GQA through ``enable_gqa`` (no repeated K/V, so it reads the same bytes as the others)."""

    def __init__(self, backend: str):
        super().__init__(backend)
        self.description += ", contiguous cache"

    def prepare(self, case: DecodeCase, requires_grad: bool = False) -> Prepared:
        context = case.context
        q = case.q.transpose(1, 2).contiguous()                                  # [B, Hq, 1, D]
        k, v = (c[:, :context].transpose(1, 2).contiguous() for c in (case.k_cache, case.v_cache))
        return Prepared((q, k, v, False))


class FlashAttn4Decode(_CacheProvider):
    """FlashAttention 4 (``flash_attn.cute.flash_attn_varlen_func``) with ``seqused_k``, and
    ``page_table`` when paged. num_splits=0 lets it choose split-KV. Soft-capping, (sm90+) sinks and
    windows as in ``providers.FlashAttn4``."""

    VARIANTS = {"softcap": "softcap", "sinks": "learnable_sink"}
    windows = True
    window_kwargs = FlashAttn4.window_kwargs

    def __init__(self, paged: bool):
        super().__init__(paged, "fa4", "flash_attn.cute.flash_attn_varlen_func")

    def load(self):
        from flash_attn.cute import flash_attn_varlen_func

        self.fn = flash_attn_varlen_func

    def setup(self, wl, device):
        fa4_variant_checks(wl, self.fn.__module__, "FlashAttnVarlenFunc")

    def sinks_argument(self, sinks):
        return sinks.to(torch.bfloat16)

    def run(self, q, k, v, seqused_k, page_table):
        return first(self.fn(q, k, v, seqused_k=seqused_k, page_table=page_table, num_splits=0,
                             **self.call_kwargs))


def decode_providers() -> list[Provider]:
    """Every decode provider, in the order of the tables."""
    return [TriflashKVCache(paged=False), TriflashKVCache(paged=True),
            *(SdpaDecode(b) for b in Sdpa.BACKENDS), FlashAttn4Decode(paged=False),
            FlashAttn4Decode(paged=True)]

