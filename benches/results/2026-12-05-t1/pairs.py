#!/usr/bin/env python3
"""hot runs of this folder, newcache-threads: per concurrency, every run in order, the
adjacent pairs' new / base, and each side's median (python3 pairs.py)."""
import glob, json, os, re, statistics
HERE = os.path.dirname(os.path.abspath(__file__))
runs = {}
for f in glob.glob(os.path.join(HERE, "hot-*.jsonl")):
    m = re.match(r"hot-(\d+)-(\w+)\.jsonl", os.path.basename(f))
    i, side = int(m.group(1)), m.group(2)
    for line in open(f):
        if line.startswith("{"):
            r = json.loads(line)
            runs.setdefault(i, {"side": side})[r["concurrency"]] = (r["gets_per_s"], r["p99_us"])
for c in (64, 256):
    seq = [(i, runs[i]["side"], runs[i][c]) for i in sorted(runs) if c in runs[i]]
    print(f"## {c} threads: {len(seq)} runs (gets/s in thousands, b = base, n = new)\n")
    print(" ".join(f"{i}{s[0]}:{g[0] / 1000:.0f}" for i, s, g in seq))
    ratios = []
    for a in range(1, len(seq), 2):
        x, y = seq[a - 1], seq[a]
        n, b = (x, y) if x[1] == "new" else (y, x)
        if n[1] == "new" and b[1] == "base":
            ratios.append(n[2][0] / b[2][0])
    for side in ("base", "new"):
        xs = [g[0] for _, s, g in seq if s == side]
        p99 = [g[1] for _, s, g in seq if s == side]
        print(f"\n{side}: {len(xs)} runs, median {statistics.median(xs):,.0f} gets/s, "
              f"quartiles {', '.join(f'{q:,.0f}' for q in statistics.quantiles(xs, n=4))}; "
              f"median p99 {statistics.median(p99):,.0f} us")
    print(f"\npairs new / base: {' '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f}\n")
