#!/usr/bin/env python3
"""bus.sh's coherence probe: a PUT /users/ID on the writer, then the reader polled until it
returns the new name; the time from the PUT's return to that read's return, per trial.

Each trial first reads the user on the reader until a read is served from its near copy, waits
a random pause (a write comes at any time), reads once more (noting whether that read was a near
hit), then renames the user on the writer, then polls the reader on a kept-alive connection.
Writes OUT (TSV, one row per trial) and prints a one-line summary.
"""

import argparse
import http.client
import json
import random
import statistics
import time


def request(conn, method, path, body=None):
    headers = {"content-type": "application/json"} if body is not None else {}
    conn.request(method, path, body=body, headers=headers)
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise SystemExit(f"{method} {path}: {response.status} {data[:200]!r}")
    return json.loads(data)


def near_hits(conn):
    """The reader's cache's near hits so far (its own calls: reports and users)."""
    return request(conn, "GET", "/stats")["cache"]["near_hits"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--writer", type=int, required=True, help="port of the process written to")
    ap.add_argument("--reader", type=int, required=True, help="port of the process polled")
    ap.add_argument("--user", type=int, default=42)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--pause", type=float, default=2.0, help="most seconds between the near hit and the PUT")
    ap.add_argument("--give-up", type=float, default=15.0, help="seconds without the new value")
    ap.add_argument("--tag", default="probe")
    ap.add_argument("out")
    args = ap.parse_args()

    writer = http.client.HTTPConnection("127.0.0.1", args.writer, timeout=10)
    reader = http.client.HTTPConnection("127.0.0.1", args.reader, timeout=10)
    path = f"/users/{args.user}"
    rows = []
    for trial in range(1, args.trials + 1):
        # Read until the reader serves the user from its near copy (its first reads after a
        # load may go to memcached).
        hits = near_hits(reader)
        for _ in range(200):
            old = request(reader, "GET", path)["name"]
            if near_hits(reader) > hits:
                break
            time.sleep(0.005)
        else:
            raise SystemExit(f"trial {trial}: the reader keeps no near copy of {path}")
        # A write comes at any time, not just after a read: a random pause, then one more read
        # (is it still served from the near copy?), then the write.
        time.sleep(random.uniform(0, args.pause))
        hits = near_hits(reader)
        old = request(reader, "GET", path)["name"]
        near_before = int(near_hits(reader) > hits)
        new = f"{args.tag}-{trial}-{random.randrange(1 << 30):x}"
        started = time.monotonic()
        request(writer, "PUT", path, json.dumps({"name": new}))
        written = time.monotonic()
        stale = 0
        while True:
            name = request(reader, "GET", path)["name"]
            now = time.monotonic()
            if name == new:
                break
            if name != old:
                raise SystemExit(f"trial {trial}: read {name!r}, neither {old!r} nor {new!r}")
            stale += 1
            if now - written > args.give_up:
                raise SystemExit(f"trial {trial}: still {old!r} {args.give_up} s after the PUT")
        rows.append((trial, (written - started) * 1e3, (now - written) * 1e3, stale, near_before))

    with open(args.out, "w") as f:
        f.write("trial\tput_ms\tseen_after_put_ms\tstale_reads\tnear_copy_before\n")
        for r in rows:
            f.write(f"{r[0]}\t{r[1]:.2f}\t{r[2]:.2f}\t{r[3]}\t{r[4]}\n")
    seen = sorted(r[2] for r in rows)
    print(
        f"{args.tag}: {len(rows)} trials, seen after the PUT in p50 {statistics.median(seen):.1f} ms,"
        f" max {seen[-1]:.1f} ms; stale reads {sum(r[3] for r in rows)}"
    )


if __name__ == "__main__":
    main()
