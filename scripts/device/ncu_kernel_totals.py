#!/usr/bin/env python3
"""Device time per kernel name over a whole run, from Nsight Compute's CSV.

Input: `ncu --metrics gpu__time_duration.sum --csv <command>` (each kernel timed alone). Output: the
total, then one line per kernel name (template arguments kept, parameters and namespaces dropped),
largest first: milliseconds, share, launches. For a prefill, where one chunk is most of the run;
for one decode step use ncu_step_summary.py.

    python3 ncu_kernel_totals.py ncu.csv [top N]
"""
import collections
import csv
import re
import sys


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    header, total, count = None, collections.defaultdict(float), collections.Counter()
    for r in csv.reader(open(path)):
        if r and r[0] == "ID":
            header = r
            continue
        if not header or len(r) != len(header):
            continue
        d = dict(zip(header, r))
        v = float(d["Metric Value"].replace(",", ""))
        unit = d["Metric Unit"]
        us = v / 1000 if unit in ("ns", "nsecond") else v * 1000 if unit in ("ms", "msecond") else v
        name = d["Kernel Name"].replace("(anonymous namespace)::", "").replace("sparsemla::", "")
        name = re.sub(r"\(.*", "", name).replace("void ", "")[:100]
        total[name] += us
        count[name] += 1
    if not total:
        sys.exit(f"{path}: no kernel times (was ncu run with --csv and gpu__time_duration.sum?)")
    all_us = sum(total.values())
    print(f"total kernel time {all_us / 1000:.2f} ms over {sum(count.values())} launches")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{us / 1000:9.3f} ms {100 * us / all_us:5.1f}% {count[name]:6d}  {name}")


if __name__ == "__main__":
    main()
