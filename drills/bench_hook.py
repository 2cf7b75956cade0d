"""Let ``triflash bench`` time a learner's T5 kernel (drills/mine/) or the reference solution beside
triflash and naive PyTorch.

* ``t5_provider(target)`` -> ``fn(q, k, v, causal)`` on [B, H, S, D] tensors, returning the output. Usable
  from any script: ``fn = t5_provider("mine"); o = fn(q, k, v, True)``.
* ``drill_providers()`` -> provider objects for triflash's bench (``drill:t5`` for mine/,
  ``drill:t5-solution`` for solutions/), built on ``triflash.bench.providers.Provider`` with the "bhsd"
  layout; not run unless named in ``--providers``. A learner's kernel that is not written yet is
  reported by the bench as unavailable, with the "not written yet" message as the reason.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

DRILLS = Path(__file__).resolve().parent
if str(DRILLS) not in sys.path:
    sys.path.insert(0, str(DRILLS))


def t5_provider(target: str = "mine"):
    """The T5 forward of drills/<target>/ as fn(q, k, v, causal) -> o, q/k/v [B, H, S, D] fp16/bf16."""
    if target not in ("mine", "solutions"):
        raise ValueError(f"target: expected 'mine' or 'solutions', got {target!r}")
    module = importlib.import_module(f"{target}.t5_flash_attn")

    def run(q, k, v, causal: bool = False):
        return module.flash_attn(q, k, v, causal=causal)

    run.__name__ = f"drill_t5_{target}"
    run.module = module
    return run


def drill_providers():
    """Providers for triflash.bench (imported lazily so that this file works without triflash)."""
    from triflash.bench.providers import Provider, Unavailable

    class DrillT5(Provider):
        layout = "bhsd"
        default = False

        def __init__(self, target: str):
            self.target = target
            self.name = "drill:t5" if target == "mine" else "drill:t5-solution"
            self.description = f"drills/{target}/t5_flash_attn.py (the T5 drill)"

        def load(self):
            from drill_common import require_written

            self.fn = t5_provider(self.target)
            mod = self.fn.module
            try:
                require_written(mod._attn_fwd_kernel, mod._attn_fwd_inner,
                                where=f"drills/{self.target}/t5_flash_attn.py")
            except NotImplementedError as exc:
                raise ImportError(str(exc)) from exc

        def setup(self, wl, device):
            if wl.heads_kv != wl.heads or wl.seqlen_q != wl.seqlen_k:
                raise Unavailable("the T5 drill has one K/V head per query head and Sq == Sk")
            if wl.dtype not in ("fp16", "bf16"):
                raise Unavailable("the T5 drill takes fp16 or bf16")
            if wl.head_dim not in (16, 32, 64, 128):
                raise Unavailable("the T5 drill takes head_dim 16, 32, 64 or 128")

        def run(self, q, k, v, causal):
            return self.fn(q, k, v, causal)

    return [DrillT5("mine"), DrillT5("solutions")]
