"""triflash: FlashAttention in Python with Triton."""

from .api import attention, flash_attn_func, flash_attn_varlen_func
from .kvcache import flash_attn_with_kvcache, merge_attn_states

__version__ = "0.1.0"

__all__ = ["attention", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "merge_attn_states",
           "__version__"]
