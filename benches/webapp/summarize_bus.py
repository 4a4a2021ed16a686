#!/usr/bin/env python3
"""Reads bus.sh's raw outputs in OUT_DIR and writes OUT_DIR/results.json and results.md."""

import argparse
import csv
import json
import math
import os
import re
import statistics

MODES = {"bus": "near tier + bus", "near": "near tier alone"}
NEAR_TTL_MS = 5000.0  # the near tier's default ttl, which the service keeps


def millis(text):
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}[m.group(2)]


def parse_wrk(path):
    text = open(path).read()
    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    if not rps:
        raise SystemExit(f"{path}: no Requests/sec line (did wrk fail?)\n{text}")
    lat = dict(re.findall(r"^\s+(50|99)%\s+(\S+)\s*$", text, re.M))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    errors = re.search(r"Socket errors: (.*)", text)
    return {
        "requests_per_sec": float(rps.group(1)),
        "p50_ms": millis(lat["50"]),
        "p99_ms": millis(lat["99"]),
        "non_2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": errors.group(1).strip() if errors else None,
    }


def counters(path):
    """{(name, labels): value} from the Prometheus lines bus.sh kept."""
    found = {}
    for line in open(path):
        m = re.fullmatch(r"(\w+)\{(.*)\} (\S+)\n?", line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2))))
            found[(m.group(1), labels)] = float(m.group(3))
    return found


def delta(out, mode, n):
    before = counters(os.path.join(out, f"{mode}-counters-{n}-before.txt"))
    after = counters(os.path.join(out, f"{mode}-counters-{n}-after.txt"))
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def load(out, mode, window, ttl):
    processes = []
    queries = {}
    for n in (1, 2):
        wrk = parse_wrk(os.path.join(out, f"{mode}-wrk-{n}.txt"))
        d = delta(out, mode, n)
        wrk["status_5xx"] = int(sum(v for (name, labels), v in d.items()
                                    if name == "webapp_http_requests_total"
                                    and dict(labels).get("status", "").startswith("5")))
        for (name, labels), v in d.items():
            if name == "webapp_db_queries_total":
                q = dict(labels)["query"]
                queries[q] = queries.get(q, 0) + int(v)
        stats = json.load(open(os.path.join(out, f"{mode}-load-stats-{n}.json")))
        wrk["bus"] = {k: v for k, v in stats["cache"].items() if k.startswith("bus_")}
        wrk["near_hits"] = stats["cache"].get("near_hits", 0) + stats["pages"].get("near_hits", 0)
        processes.append(wrk)
    expiries = window / ttl
    return {
        "ttl_secs": ttl,
        "window_secs": window,
        "expiries": expiries,
        "processes": processes,
        "db_queries": queries,
        "report_queries_per_expiry": queries.get("report", 0) / expiries,
        "page_renders_per_expiry": queries.get("latest_orders", 0) / expiries,
        # The window's edges: at most ceil(window / ttl) expiries can fall inside it.
        "at_most_one_per_expiry": max(queries.get("report", 0), queries.get("latest_orders", 0))
        <= math.ceil(expiries),
    }


def coherence(out, mode):
    rows = list(csv.DictReader(open(os.path.join(out, f"{mode}-coherence.tsv")), delimiter="\t"))
    seen = sorted(float(r["seen_after_put_ms"]) for r in rows)
    q = statistics.quantiles(seen, n=10, method="inclusive") if len(seen) > 1 else seen * 9
    return {
        "writes": len(rows),
        "seen_after_put_ms": {"min": seen[0], "p50": statistics.median(seen), "p90": q[8], "max": seen[-1]},
        "put_ms_p50": statistics.median(float(r["put_ms"]) for r in rows),
        "stale_reads": sum(int(r["stale_reads"]) for r in rows),
        "near_copy_before": sum(int(r.get("near_copy_before") or 0) for r in rows),
        "over_100ms": sum(1 for x in seen if x > 100),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--window", type=float, required=True)
    ap.add_argument("--ttl", type=float, required=True)
    args = ap.parse_args()

    doc = {"near_ttl_ms": NEAR_TTL_MS}
    for mode in MODES:
        doc[mode] = {"load": load(args.out, mode, args.window, args.ttl), "coherence": coherence(args.out, mode)}

    lines = [
        "Two processes of examples/webapp over one memcached, each with a 64 MiB near tier (near ttl 5 s):"
        " `bus` also on `--bus-redis` (a redis-server on loopback), `near` the near tier alone.",
        "",
        f"## Under load: --ttl-secs {args.ttl:g}, {args.window:g} s, one `wrk -t1 -c32` per process at once,"
        " /report/1 and /page/1 alternating",
        "",
        "| mode | process | requests/s | p50 | p99 | 5xx | non-2xx (wrk) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for mode, label in MODES.items():
        for n, p in enumerate(doc[mode]["load"]["processes"], 1):
            lines.append(f"| {label} | {n} | {p['requests_per_sec']:,.0f} | {p['p50_ms']:.2f} ms |"
                         f" {p['p99_ms']:.2f} ms | {p['status_5xx']} | {p['non_2xx']} |")
    lines += [
        "",
        "Database queries summed over both processes (`report`: a /report/1 load; `latest_orders`:"
        " a /page/1 render):",
        "",
        "| mode | expiries (window / ttl) | report queries | per expiry | page renders | per expiry |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, label in MODES.items():
        l = doc[mode]["load"]
        lines.append(f"| {label} | {l['expiries']:g} | {l['db_queries'].get('report', 0)} |"
                     f" {l['report_queries_per_expiry']:.2f} | {l['db_queries'].get('latest_orders', 0)} |"
                     f" {l['page_renders_per_expiry']:.2f} |")
    lines += [
        "",
        "## A write in process 1, process 2's next read: --ttl-secs 60",
        "",
        "Per write: process 2 reads `GET /users/42` until a read is a near hit, waits a random"
        " pause (0-2 s), reads once more, then `PUT /users/42` on process 1 (a new name), then"
        " process 2 is polled on a kept-alive connection; the time from the PUT's return to the"
        " first read returning the new name.",
        "",
        "| mode | writes (the read before it a near hit) | min | p50 | p90 | max | writes seen after > 100 ms | stale reads in all |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, label in MODES.items():
        c = doc[mode]["coherence"]
        s = c["seen_after_put_ms"]
        lines.append(f"| {label} | {c['writes']} ({c['near_copy_before']}) | {s['min']:.1f} ms | {s['p50']:.1f} ms |"
                     f" {s['p90']:.1f} ms | {s['max']:.1f} ms | {c['over_100ms']} | {c['stale_reads']} |")

    bus = doc["bus"]
    checks = {
        "no 5xx": all(p["status_5xx"] == 0 and p["non_2xx"] == 0
                      for m in MODES for p in doc[m]["load"]["processes"]),
        "at most 1 database query per expiry across both processes, with the bus":
            bus["load"]["at_most_one_per_expiry"],
        "with the bus, every write seen in under a tenth of the near ttl (500 ms)":
            bus["coherence"]["seen_after_put_ms"]["max"] < NEAR_TTL_MS / 10,
    }
    doc["checks"] = checks
    lines += ["", "Checks:", ""]
    lines += [f"- {name}: {'ok' if ok else 'FAILED'}" for name, ok in checks.items()]
    counted = [f"process {n}: " + ", ".join(f"{k} {v}" for k, v in p["bus"].items())
               for n, p in enumerate(bus["load"]["processes"], 1) if p["bus"]]
    if counted:
        lines += ["", "The bus's counters after the load (`/stats`, the cache's own calls): " + "; ".join(counted)]

    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(doc, f, indent=2)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
