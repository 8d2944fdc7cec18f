#!/usr/bin/env python3
"""Kernel-by-kernel device time of the last decode step, from Nsight Compute's CSV.

Input: `ncu --metrics gpu__time_duration.sum --csv` over `sparsemla bench ... --gen N` with CUDA
graphs off (SPARSEMLA_CUDA_GRAPHS=0), so that every kernel is launched, and timed, on its own.
A step starts at the embedding lookup (dequantize_rows_kernel); the last one is summarized: per
kernel name and launch shape, the calls and the summed microseconds, largest first. Each kernel is
timed alone (ncu serializes them), so the sum is the step's kernel time without overlap or gaps.

    python3 ncu_step_summary.py ncu_step.csv [top N]
"""
import collections
import csv
import re
import sys


def microseconds(row):
    value = float(row["Metric Value"].replace(",", ""))
    return {"ns": value / 1000, "us": value, "usecond": value, "ms": value * 1000, "msecond": value * 1000}.get(
        row["Metric Unit"], value / 1000)


def main():
    header, rows = None, []
    for r in csv.reader(open(sys.argv[1])):
        if r and r[0] == "ID":
            header = r
        elif header and len(r) == len(header):
            rows.append(dict(zip(header, r)))
    starts = [i for i, r in enumerate(rows) if "dequantize_rows_kernel" in r["Kernel Name"]]
    if not starts:
        sys.exit("no step found: no dequantize_rows_kernel (the embedding lookup) in the profile")
    step = rows[starts[-1]:]
    print(f"last step: {len(step)} kernels, {sum(microseconds(r) for r in step):.1f} us of kernel time")
    per = collections.OrderedDict()
    for r in step:
        name = re.sub(r"\(.*", "", r["Kernel Name"]).replace("void ", "")[:70]
        key = f"{name} {r['Grid Size']}x{r['Block Size']}"
        calls, us = per.get(key, (0, 0.0))
        per[key] = (calls + 1, us + microseconds(r))
    top = int(sys.argv[2]) if len(sys.argv) > 2 else len(per)
    for key, (calls, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{calls:4d} {us:9.1f} us  {key}")


if __name__ == "__main__":
    main()
