#!/usr/bin/env bash
# The GPU test suites, in four parts that each fit one device call (10 minutes): what a change made
# on a machine without a GPU owes before it is called verified on one.
#
#   bash scripts/gpu_checks.sh fwd   # forward suites, causal and empty rows, packed sequences (their
#                                    # Hopper backward too), windows, and (one test at a time) the
#                                    # 4 GiB offset tests
#   bash scripts/gpu_checks.sh bwd   # the backward suite
#   bash scripts/gpu_checks.sh rest  # decode, merge, SDPA routing, compile, validation, layouts
#   bash scripts/gpu_checks.sh variants  # score variants (the Hopper kernels' too), atomic dQ, the
#                                        # single-launch backward, deterministic=, call plans
#   bash scripts/gpu_checks.sh pending   # the latest additions' tests (passed on an H100, 2026-12-07):
#                                        # the Gluon decode kernel with windows and score variants,
#                                        # ALiBi's distance per head dim and its large-slope test, the
#                                        # one-pass backward (split_tma) under every score variant and
#                                        # unforced
#
# Logs go to $OUT (the device tool's folder that comes back), a short summary to stdout. The hang
# guard (tests/conftest.py) ends a test that runs past TRIFLASH_TEST_TIMEOUT seconds.
set -u
part=${1:?usage: gpu_checks.sh fwd|bwd|rest|variants|pending}
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
export PYTHONPATH=src TRIFLASH_TEST_TIMEOUT=${TRIFLASH_TEST_TIMEOUT:-240}
python3 - <<'EOF' | tee "$OUT/versions.txt"
import torch, triton
print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
EOF

run() {   # run NAME PYTEST-ARGS...: one pytest run, its log in $OUT/NAME.log, its summary line here
    local name=$1
    shift
    local start=$SECONDS
    python3 -m pytest -q -p no:benchmark -ra "$@" > "$OUT/$name.log" 2>&1
    echo "$name: rc=$? in $((SECONDS - start)) s: $(tail -n 1 "$OUT/$name.log")"
}

case $part in
fwd)
    run fwd -n 16 tests/test_forward.py tests/test_causal_and_empty.py tests/test_varlen.py tests/test_window.py
    # 4-5 GiB tensors and float64 references (up to ~60 GiB): one test at a time.
    run int64 -n 1 tests/test_int64_offsets.py tests/test_long_sequences.py
    ;;
bwd)
    run bwd -n 16 tests/test_backward.py
    ;;
rest)
    # 16 workers ran an 80 GB H100 out of memory on the decode suites; the 128k-key cases take
    # several GiB each (float64 references), so they run alone.
    run decode -n 8 tests/test_decode.py tests/test_decode_hopper.py -k "not long_context"
    run decode_long -n 1 tests/test_decode.py tests/test_decode_hopper.py -k "long_context"
    run rest -n 16 tests/test_merge.py tests/test_integrations.py tests/test_compile.py tests/test_validation.py \
        tests/test_layouts.py tests/test_devices.py tests/test_readme.py
    ;;
variants)
    run variants -n 16 tests/test_variants.py tests/test_backward_atomic.py tests/test_backward_single.py \
        tests/test_deterministic.py tests/test_launch.py
    ;;
pending)
    run pending_decode -n 8 tests/test_decode_hopper.py -k "windows_and_score_variants or switched_on"
    run pending_variants -n 16 tests/test_variants.py -k "alibi or diagonal or split_tma"
    run pending_one_pass -n 2 tests/test_backward.py -k "one_pass_backward_unforced"
    ;;
*)
    echo "unknown part $part (fwd, bwd, rest, variants or pending)" >&2
    exit 2
    ;;
esac
