#!/usr/bin/env bash
# Same speed? This tree against another one (its src/ directory), on one GPU, in the order before,
# after, after, before (ABBA: drift on the machine cancels), each run in its own process; then a table
# of the median ms of each workload, the mean of the two rounds of each tree, and after / before.
#
#   git worktree add /tmp/before <commit>     # or copy its src/ anywhere
#   bash scripts/abba.sh /tmp/before/src --mode fwd --batch 4 --heads 16 --seqlen 4096 --headdim 64 128
#
# The arguments after the first go to `triflash bench` (default provider: triflash, the chooser's
# kernels). Logs: $OUT/abba.md (default /tmp/abba).
set -u
before=${1:?usage: abba.sh BEFORE_SRC BENCH-ARGS...}
shift
OUT=${OUT:-/tmp/abba}
mkdir -p "$OUT"
: > "$OUT/abba.md"
for tree in before after after before; do
    src=src
    [ "$tree" = before ] && src=$before
    echo "## tree $tree" >> "$OUT/abba.md"
    PYTHONPATH=$src python3 -m triflash.bench --providers triflash --no-plots --out "$OUT/bench" "$@" 2>/dev/null \
        | grep -E "^(\||## )" | grep -v -- "---" | grep -v "^| S " >> "$OUT/abba.md"
done
python3 - "$OUT/abba.md" <<'PY'
import collections, re, sys
times = collections.defaultdict(lambda: collections.defaultdict(list))
tree = workload = None
for line in open(sys.argv[1]):
    if m := re.match(r"## tree (\w+)", line):
        tree = m.group(1)
    elif line.startswith("## "):
        workload = line[3:].strip()
    elif line.startswith("|"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        times[(workload, cells[0], cells[3])][tree].append(float(cells[4]))
print("| workload | S | provider | before ms | after ms | after / before |")
print("|---|---|---|---|---|---|")
for (workload, s, provider), t in sorted(times.items()):
    b, a = (sum(t[k]) / len(t[k]) for k in ("before", "after"))
    print(f"| {workload} | {s} | {provider} | {b:.3f} | {a:.3f} | {a / b:.3f} |")
PY
