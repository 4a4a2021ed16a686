#!/usr/bin/env python3
"""Reads criterion outputs of the get_many_100 group (one file per process) and prints each
run's ratios and their medians: newcache over the memcache crate on its raw items (the goal),
newcache over the crate reading newcache's own items, and the wire (bare socket, newcache's
items over raw items)."""
import re
import statistics
import sys

rows = []
for path in sys.argv[1:]:
    text = open(path).read()
    t = {}
    for name, mid, unit in re.findall(r"memcached/get_many_100/(\S+)\s+time:\s+\[\S+ \S+ (\S+) (\S+)", text):
        t[name] = float(mid) * {"ns": 1e-3, "µs": 1.0, "us": 1.0, "ms": 1e3}[unit]
    if {"newcache", "memcache-crate"} <= t.keys():
        rows.append((path, t))
print("| run | newcache | crate | newcache / crate | crate, same items | newcache / crate same items | wire: bare same / bare raw |")
print("|---|---:|---:|---:|---:|---:|---:|")
goal, same, wire = [], [], []
for path, t in rows:
    g = t["newcache"] / t["memcache-crate"]
    s = t["newcache"] / t["memcache-crate-same-items"]
    w = t["bare-socket-same-items"] / t["bare-socket"]
    goal.append(g); same.append(s); wire.append(w)
    print(f"| {path.rsplit('/', 1)[-1]} | {t['newcache']:.1f} us | {t['memcache-crate']:.1f} us | {g:.3f} | "
          f"{t['memcache-crate-same-items']:.1f} us | {s:.3f} | {w:.3f} |")
if rows:
    print(f"| **median of {len(rows)}** | | | **{statistics.median(goal):.3f}** | | "
          f"**{statistics.median(same):.3f}** | **{statistics.median(wire):.3f}** |")
