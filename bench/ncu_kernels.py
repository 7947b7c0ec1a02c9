#!/usr/bin/env python3
"""Sum the kernel times of an Nsight Compute CSV by kernel.

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv --page raw \
        --print-units base --log-file K.csv bench/bench_decode ... --batches 1 --new 5
    bench/ncu_kernels.py K.csv --steps 4

Prints, per kernel name, the launches and the device time per step (the run's total over
--steps), largest first, and the sum: the time the device spends running kernels in a step.
Set against the step's time measured without the profiler, the rest is time the device sat idle
between kernels. ncu runs each kernel alone (serialised), so the times are each kernel's own.
"""
import argparse
import collections
import csv
import sys


def die(msg):
    print(f"ncu_kernels: {msg}", file=sys.stderr)
    sys.exit(2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --csv --page raw output (--log-file)")
    ap.add_argument("--steps", type=int, default=1, help="steps the profiled range holds")
    ap.add_argument("--top", type=int, default=40, help="kernels to list")
    ap.add_argument("--width", type=int, default=70, help="characters of each name")
    args = ap.parse_args()
    for flag, v in (("--steps", args.steps), ("--top", args.top), ("--width", args.width)):
        if v < 1:
            die(f"{flag} must be at least 1, got {v}")
    try:
        with open(args.csv, newline="") as f:
            lines = [l for l in f if l.startswith('"')]  # ncu's own ==PROF== lines dropped
    except OSError as e:
        die(str(e))
    rows = list(csv.reader(lines))
    if not rows or "Kernel Name" not in rows[0] or "gpu__time_duration.sum" not in rows[0]:
        die(f"{args.csv} has no 'Kernel Name' and gpu__time_duration.sum columns")
    name_col = rows[0].index("Kernel Name")
    time_col = rows[0].index("gpu__time_duration.sum")
    unit = rows[1][time_col] if len(rows) > 1 else ""
    scale = {"ns": 1e-3, "usecond": 1.0, "us": 1.0, "nsecond": 1e-3, "msecond": 1e3}.get(unit)
    if scale is None:
        die(f"unknown time unit '{unit}' (run ncu with --print-units base)")
    total = collections.Counter()
    calls = collections.Counter()
    for r in rows[2:]:
        try:
            t = float(r[time_col].replace(",", ""))
        except (ValueError, IndexError):
            continue
        total[r[name_col]] += t * scale
        calls[r[name_col]] += 1
    if not calls:
        die(f"{args.csv} holds no timed kernel")
    s = args.steps
    whole = sum(total.values())
    print(f"{sum(calls.values()) / s:.1f} kernels, {whole / s:.1f} us of kernel time per step")
    print(f"{'us/step':>9} {'share':>6} {'calls/step':>10}  kernel")
    for name, t in total.most_common(args.top):
        print(f"{t / s:9.1f} {100 * t / whole:5.1f}% {calls[name] / s:10.1f}  {name[:args.width]}")


if __name__ == "__main__":
    main()
