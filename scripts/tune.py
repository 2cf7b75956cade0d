"""Time every kernel variant the dispatcher can pick, side by side, through ``triflash bench``.

Each variant is a ``triflash@...`` provider (``dispatch.force``): the portable Triton kernels and every
Gluon forward and backward variant this Triton has, beside triflash's own pick and the peers named
with --peers. The bench checks each one against the reference before timing it (a wrong one is not
timed) and writes its usual tables and JSON, so a rule in ``kernels/dispatch.py`` can be re-checked
with one command. Decode configs are timed by ``triflash bench --mode decode`` itself.

    python scripts/tune.py --mode fwd --seqlen 1024,4096 --headdim 64,128 [--out DIR] [--peers sdpa-cudnn,fa4]
    python scripts/tune.py --mode bwd --dry-run       # print the bench command, run nothing
"""

import argparse
import shlex
import sys

from triflash.bench import cli
from triflash.kernels import dispatch


def variant_providers(mode: str) -> list[str]:
    """The triflash@ providers of ``mode``: the Triton kernels and every Gluon variant of that pass
    (the backward modes force the backward's variant; the forward keeps its own pick there)."""
    forward_names, backward_names = dispatch.variant_names()
    names = forward_names if mode == "fwd" else backward_names
    return [f"triflash@{dispatch.TRITON}"] + [f"triflash@{n}" for n in names]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["fwd", "bwd", "fwdbwd"], default="fwd")
    ap.add_argument("--peers", default="", help="other providers to time beside them (bench names)")
    ap.add_argument("--dry-run", action="store_true", help="print the bench command and exit")
    args, bench_args = ap.parse_known_args(argv)
    providers = ["triflash", *variant_providers(args.mode), *filter(None, args.peers.split(","))]
    command = ["--mode", args.mode, "--providers", ",".join(providers), *bench_args]
    print("triflash bench " + shlex.join(command), file=sys.stderr)
    if args.dry_run:
        return 0
    return cli.main(command)


if __name__ == "__main__":
    sys.exit(main())
