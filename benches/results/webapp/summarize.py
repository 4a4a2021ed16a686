#!/usr/bin/env python3
"""Summarise the closing sitting's raw files (run.sh's output, in this folder).

    python3 benches/results/2026-12-04-final/summarize.py [FOLDER] > summary.md

(FOLDER: another sitting's raw files of the same names; this folder by default.)

For each floor path and side (base, new): every run's median ratio (client / floor; for
gets/s, client / floor too, above 1 = more) and the median and quartiles of all the runs'
rounds pooled. For hot: each client and concurrency, gets/s and p99 per run and their median
per side, and new / base.
"""
import glob
import json
import os
import re
import statistics
import sys
from collections import defaultdict

HERE = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))


def quartiles(xs):
    xs = sorted(xs)
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def rows_of(doc):
    """(server, row) pairs of one floor JSON file."""
    if "rows" in doc:
        yield doc.get("memcached", "memcached"), doc["rows"]
    for key in ("redis", "redis_cluster"):
        part = doc.get(key)
        if isinstance(part, list):
            for server in part:
                yield server.get("server", key), server["rows"]
        elif isinstance(part, dict):
            yield part.get("server", key), part["rows"]


def floor():
    runs = defaultdict(list)  # (kind, server, path, floor) -> [(side, run, row)]
    for f in sorted(glob.glob(os.path.join(HERE, "floor-*.json"))):
        m = re.match(r"floor-([\w-]+?)-(\d+)-(\w+)\.json", os.path.basename(f))
        name = os.path.basename(f)
        kind, run, side = (m.group(1), int(m.group(2)), m.group(3)) if m else (name, 0, "new")
        doc = json.load(open(f))
        for server, rows in rows_of(doc):
            for row in rows:
                key = (kind, server.split(" (")[0][:40], row["path"], row.get("floor", ""))
                runs[key].append((side, run, row))
    print("## Floor: client / floor (median of each run's rounds; then all rounds pooled)\n")
    print("| bench | server | path | floor | side | runs' medians | pooled median (IQR) | client medians |")
    print("|---|---|---|---|---|---|---|---|")
    for key, entries in runs.items():
        for side in ("base", "new"):
            mine = [(r, row) for s, r, row in entries if s == side]
            if not mine:
                continue
            meds = ", ".join(f"{row['ratio']['median']:.3f}" for _, row in mine)
            pooled = [x for _, row in mine for x in row["ratios"]]
            q1, med, q3 = quartiles(pooled)
            unit = mine[0][1].get("unit", "")
            clients = ", ".join(f"{row['client_median']:.1f}" for _, row in mine)
            print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {side} | {meds} | "
                  f"{med:.3f} ({q1:.3f}-{q3:.3f}) | {clients} {unit} |")
    print()


def hot():
    data = defaultdict(lambda: defaultdict(list))  # (client, conc) -> side -> [(gets/s, p99)]
    for f in sorted(glob.glob(os.path.join(HERE, "hot-*.jsonl"))):
        m = re.match(r"hot-(\d+)-(\w+)\.jsonl", os.path.basename(f))
        if not m:
            continue
        side = m.group(2)
        for line in open(f):
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            data[(r["client"], r["concurrency"])][side].append((r["gets_per_s"], r["p99_us"]))
    if not data:
        return
    print("## Hot keys (benches/hot, multi-thread runtime, 2 workers): gets/s (p99 us)\n")
    print("| client | tasks | base runs | new runs | base median | new median | new / base |")
    print("|---|---:|---|---|---:|---:|---:|")
    for (client, conc), sides in sorted(data.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        def runs(side):
            return ", ".join(f"{g:,.0f} ({p:,.0f})" for g, p in sides.get(side, []))

        def med(side):
            xs = [g for g, _ in sides.get(side, [])]
            return statistics.median(xs) if xs else float("nan")

        b, n = med("base"), med("new")
        print(f"| {client} | {conc} | {runs('base')} | {runs('new')} | {b:,.0f} | {n:,.0f} | "
              f"{n / b:.3f} |")
    print()


if __name__ == "__main__":
    floor()
    hot()
