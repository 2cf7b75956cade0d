"""The ``triflash bench`` command: triflash side by side with other attention implementations.

Read it in this order, each module has one job:

* ``workloads``  what to run: the shapes (seed workload, the papers' sweep, the decode grid) and the
  FLOP / byte conventions that turn a time into TFLOP/s or GB/s;
* ``checking``   inputs and the reference every provider is checked against before it is timed, and
  the tolerance rule;
* ``providers``  one small class per implementation (triflash, naive PyTorch, SDPA backends,
  FlashAttention 2/3/4, FlashInfer); ``decode`` holds the one-query-token (decode) providers;
* ``runner``     prepare -> check -> time -> measure memory, for every (workload, provider);
* ``report``     the header (GPU, versions), the Markdown tables and results.json;
* ``plotting``   the PNG figures (matplotlib is optional: ``pip install 'triflash[bench]'``);
* ``interpreter`` what runs without a GPU: a small correctness check in Triton's interpreter;
* ``cli``        argument parsing and ``main``.

Nothing heavy is imported here, so ``python -m triflash.bench --help`` stays fast.
"""
