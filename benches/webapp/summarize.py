#!/usr/bin/env python3
"""Reads run.sh's raw outputs in OUT_DIR and writes OUT_DIR/results.json and results.md."""

import argparse
import glob
import json
import os
import re
import statistics

UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def millis(text):
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not m:
        raise ValueError(f"not a wrk duration: {text!r}")
    return float(m.group(1)) * UNITS[m.group(2)]


def parse_wrk(path):
    text = open(path).read()
    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    if not rps:
        raise ValueError(f"{path}: no Requests/sec line (did wrk fail?)\n{text}")
    lat = dict(re.findall(r"^\s+(50|99)%\s+(\S+)\s*$", text, re.M))
    requests = re.search(r"(\d+) requests in", text)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    errors = re.search(r"Socket errors: (.*)", text)
    return {
        "requests_per_sec": float(rps.group(1)),
        "p50_ms": millis(lat["50"]),
        "p99_ms": millis(lat["99"]),
        "requests": int(requests.group(1)) if requests else None,
        "non_2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": errors.group(1).strip() if errors else None,
    }


def runs(out):
    """{(backend, route): {"processes": [...], summed and worst-of figures}}"""
    found = {}
    for path in sorted(glob.glob(os.path.join(out, "wrk-*-*.txt"))):
        m = re.fullmatch(r"wrk-(memory|memcached)-(.+)-(\d+)\.txt", os.path.basename(path))
        if not m:
            continue
        backend, route, port = m.groups()
        found.setdefault((backend, route), []).append(dict(parse_wrk(path), port=int(port)))
    result = {}
    for (backend, route), procs in found.items():
        queries_file = os.path.join(out, f"wrk-{backend}-{route}.queries")
        queries = int(open(queries_file).read()) if os.path.exists(queries_file) else None
        result[(backend, route)] = {
            "backend": backend,
            "route": route,
            "processes": procs,
            "requests_per_sec": sum(p["requests_per_sec"] for p in procs),
            "p50_ms": max(p["p50_ms"] for p in procs),
            "p99_ms": max(p["p99_ms"] for p in procs),
            "non_2xx": sum(p["non_2xx"] for p in procs),
            "db_queries": queries,
        }
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--window", type=float, required=True, help="seconds of the expiry run")
    ap.add_argument("--ttl", type=float, required=True)
    ap.add_argument("--duration", required=True)
    args = ap.parse_args()

    table = runs(args.out)
    doc = {"duration": args.duration, "runs": list(table.values()), "expiry": {}, "goals": {}}
    expiries = args.window / args.ttl
    for backend in ("memory", "memcached"):
        run = table.get((backend, "expiry"))
        if run:
            doc["expiry"][backend] = {
                "ttl_secs": args.ttl,
                "window_secs": args.window,
                "expiries": expiries,
                "db_queries": run["db_queries"],
                "db_queries_per_expiry": run["db_queries"] / expiries,
                "processes": len(run["processes"]),
            }
        cached, uncached = table.get((backend, "report-cached")), table.get((backend, "report-uncached"))
        goals = {}
        if cached and uncached and uncached["requests_per_sec"] > 0:
            goals["cached_over_uncached"] = cached["requests_per_sec"] / uncached["requests_per_sec"]
        # Round 1 is "static"/"page", round N "static-rN"/"page-rN", run in that order.
        ratios = []
        for n in range(1, 100):
            suffix = "" if n == 1 else f"-r{n}"
            page, static = table.get((backend, "page" + suffix)), table.get((backend, "static" + suffix))
            if not (page and static):
                break
            ratios.append(page["requests_per_sec"] / static["requests_per_sec"])
        if ratios:
            goals["page_over_static"] = statistics.median(ratios)
            goals["page_over_static_rounds"] = ratios
        doc["goals"][backend] = goals

    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(doc, f, indent=2)

    lines = [
        f"wrk -t2 -c64 -d{args.duration} --latency (memcached: two processes, one wrk -t1 -c32 each,"
        " at the same time; req/s summed, p50/p99 the worse process's)",
        "",
        "| backend | route | requests/s | p50 | p99 | db queries | non-2xx |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    order = ["static", "report-cached", "report-uncached", "page"]
    order += [f"{route}-r{n}" for n in range(2, 100) for route in ("static", "page")]
    order += ["expiry"]
    for (backend, route), r in sorted(table.items(), key=lambda kv: (kv[0][0] != "memory", order.index(kv[0][1]) if kv[0][1] in order else 999)):
        lines.append(
            f"| {backend} ({len(r['processes'])} proc) | {route} | {r['requests_per_sec']:,.0f} |"
            f" {r['p50_ms']:.2f} ms | {r['p99_ms']:.2f} ms | {r['db_queries']} | {r['non_2xx']} |"
        )
    lines += ["", f"Database queries per expiry (--ttl-secs {args.ttl:g}, {args.window:g} s of /report/1):", ""]
    for backend, e in doc["expiry"].items():
        lines.append(
            f"- {backend} ({e['processes']} process(es)): {e['db_queries']} queries in"
            f" {e['expiries']:g} expiries = {e['db_queries_per_expiry']:.2f} per expiry"
        )
    lines += [""]
    for backend, g in doc["goals"].items():
        parts = []
        if "cached_over_uncached" in g:
            parts.append(f"cached/uncached report {g['cached_over_uncached']:.1f}x (goal >= 50x)")
        if "page_over_static" in g:
            rounds = ", ".join(f"{x:.2f}" for x in g["page_over_static_rounds"])
            parts.append(
                f"page/static {g['page_over_static']:.2f}x, the median of {len(g['page_over_static_rounds'])}"
                f" interleaved rounds ({rounds}) (goal >= 0.8x on memory)"
            )
        lines.append(f"- {backend}: " + "; ".join(parts))
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
