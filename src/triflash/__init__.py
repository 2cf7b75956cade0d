"""triflash: FlashAttention in Python with Triton."""

from .api import attention, flash_attn_func

__version__ = "0.1.0"

__all__ = ["attention", "flash_attn_func", "__version__"]
