#!/usr/bin/env bash
# On the GPU machine: Nsight Compute's per-instruction counters (SASS, instructions executed and
# stall samples) for one kernel of one command, summed by opcode, so that the instruction mix of a
# kernel can be read off-line: where its instructions per weight go, which loads its warps wait on.
#   KERNEL   regex of the kernel name (e.g. gemv_mma_one_kernel)
#   NAME     name of the output files (default: the kernel regex, cleaned)
#   SKIP     launches of the kernel not profiled first (default 2: warm-up)
#   the command to profile follows, e.g.
#   KERNEL=gemv_mma_one_kernel scripts/device/ncu_sass.sh "$BIN/bench_cuda_matmul" --only q4_K:6144x16384:1
# Writes $OUT/sass_NAME.csv (the source page, every instruction), $OUT/sass_NAME.txt (the summary)
# and prints the summary.
set -uo pipefail
. "$(dirname "$0")/env.sh"
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
name=${NAME:-${KERNEL//[^A-Za-z0-9_]/_}}
mkdir -p "$OUT"
rep=/tmp/sass_$name
rm -f "$rep.ncu-rep"
timeout "${NCU_TIMEOUT:-240}" "$NCU" --section SourceCounters --section SpeedOfLight --section LaunchStats \
  --section Occupancy --section WarpStateStats --kernel-name regex:"$KERNEL" --launch-skip "${SKIP:-2}" \
  --launch-count 1 -o "$rep" "$@" >"$OUT/sass_${name}_run.txt" 2>&1
echo "== $name: ncu exit $?"
"$NCU" -i "$rep.ncu-rep" --page source --csv --print-source sass >"$OUT/sass_$name.csv" 2>&1
"$NCU" -i "$rep.ncu-rep" --page details >"$OUT/sass_${name}_details.txt" 2>&1
grep -E "^ +(Duration|DRAM Throughput|Registers Per Thread|Grid Size|Achieved Occupancy|Issued Warp Per Scheduler|Warp Cycles Per Issued Instruction|Executed Instructions) " \
  "$OUT/sass_${name}_details.txt" | sed 's/  */ /g'
python3 - "$OUT/sass_$name.csv" <<'EOF' | tee "$OUT/sass_$name.txt"
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1], newline='')))
head = None
for i, r in enumerate(rows):
    if any(c == 'Source' for c in r):
        head, body = r, rows[i + 1:]
        break
if head is None:
    print('no source page in', sys.argv[1]); sys.exit(0)
def col(*names):
    for n in names:
        for j, h in enumerate(head):
            if h.startswith(n):
                return j
    return None
src = head.index('Source')
ex = col('Instructions Executed', 'Warp Instructions Executed')
st = col('Warp Stall Sampling (All', 'Sampling Data (All')
def num(r, j):
    if j is None or j >= len(r): return 0.0
    try: return float(r[j].replace(',', ''))
    except ValueError: return 0.0
by_op = collections.Counter(); stall_op = collections.Counter()
tot = stot = 0.0
inst = []
for r in body:
    if len(r) <= src or not r[src].strip(): continue
    s = r[src].strip()
    op = s.split()[0]
    if op.startswith('@'): op = s.split()[1]
    op = op.split('.')[0]
    e, k = num(r, ex), num(r, st)
    by_op[op] += e; stall_op[op] += k; tot += e; stot += k
    inst.append((k, e, s))
print(f'warp instructions executed {tot:.4g}, stall samples {stot:.4g}')
print('opcode: executed (share) | stall samples (share)')
for op, e in by_op.most_common(30):
    print(f'  {op:10s} {e:12.4g} ({100 * e / max(tot, 1):5.1f}%) | {stall_op[op]:9.4g} ({100 * stall_op[op] / max(stot, 1):5.1f}%)')
print('instructions with the most stall samples:')
for k, e, s in sorted(inst, reverse=True)[:25]:
    print(f'  {k:8.4g} samples, {e:10.4g} executed: {s[:110]}')
EOF
