#!/usr/bin/env python3
"""Kernel-by-kernel device time of the last decode step, from Nsight Compute's CSV.

Input: `ncu --metrics gpu__time_duration.sum --csv` over `sparsemla bench ... --gen N` with CUDA
graphs off (SPARSEMLA_CUDA_GRAPHS=0), so that every kernel is launched, and timed, on its own.
A step starts at the embedding lookup (dequantize_rows_kernel); the last one is summarized: per
kernel name and launch shape, the calls and the summed microseconds, largest first. Each kernel is
timed alone (ncu serializes them), so the sum is the step's kernel time without overlap or gaps.

    python3 ncu_step_summary.py ncu_step.csv [top N]
    python3 ncu_step_summary.py ncu_step.csv --order            every kernel of the step, in launch order
    python3 ncu_step_summary.py ncu_3.csv --minus ncu_2.csv     per kernel and shape, this step's time
                                                                minus the other's (e.g. 3 layers - 2:
                                                                one layer)
"""
import argparse
import collections
import signal
import csv
import re
import sys


def microseconds(row):
    value = float(row["Metric Value"].replace(",", ""))
    return {"ns": value / 1000, "us": value, "usecond": value, "ms": value * 1000, "msecond": value * 1000}.get(
        row["Metric Unit"], value / 1000)


def last_step(path):
    """The rows of the last step in the CSV at `path` (from its last embedding lookup on)."""
    header, rows = None, []
    for r in csv.reader(open(path)):
        if r and r[0] == "ID":
            header = r
        elif header and len(r) == len(header):
            rows.append(dict(zip(header, r)))
    starts = [i for i, r in enumerate(rows) if "dequantize_rows_kernel" in r["Kernel Name"]]
    if not starts:
        sys.exit(f"{path}: no step found: no dequantize_rows_kernel (the embedding lookup) in the profile")
    return rows[starts[-1]:]


def key_of(row):
    name = re.sub(r"\(.*", "", row["Kernel Name"]).replace("void ", "")[:70]
    return f"{name} {row['Grid Size']}x{row['Block Size']}"


def per_kernel(step):
    per = collections.OrderedDict()
    for r in step:
        calls, us = per.get(key_of(r), (0, 0.0))
        per[key_of(r)] = (calls + 1, us + microseconds(r))
    return per


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("top", nargs="?", type=int, default=0, help="only the N largest lines")
    ap.add_argument("--order", action="store_true", help="every kernel of the step in launch order")
    ap.add_argument("--minus", metavar="CSV", help="subtract this profile's last step, per kernel and shape")
    args = ap.parse_intermixed_args()
    step = last_step(args.csv)
    total = sum(microseconds(r) for r in step)
    print(f"last step: {len(step)} kernels, {total:.1f} us of kernel time")
    if args.order:
        for r in step:
            print(f"{microseconds(r):9.1f} us  {key_of(r)}")
        return
    per = per_kernel(step)
    if args.minus:
        other = last_step(args.minus)
        less = per_kernel(other)
        print(f"minus {args.minus}: {len(other)} kernels, {sum(microseconds(r) for r in other):.1f} us; "
              f"difference {total - sum(microseconds(r) for r in other):.1f} us")
        for key in less:
            if key not in per:
                per[key] = (0, 0.0)
        per = collections.OrderedDict(
            (key, (calls - less.get(key, (0, 0.0))[0], us - less.get(key, (0, 0.0))[1]))
            for key, (calls, us) in per.items())
    lines = sorted(per.items(), key=lambda kv: -abs(kv[1][1]))
    for key, (calls, us) in lines[:args.top or len(lines)]:
        if args.minus and calls == 0 and abs(us) < 0.05:
            continue
        print(f"{calls:4d} {us:9.1f} us  {key}")


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # piped into head: stop quietly
    main()
