#!/usr/bin/env python3
"""Makes tests/data/ketama_vectors.json: where a real libmemcached client puts keys.

pylibmc (from PyPI; its wheel bundles libmemcached) with behaviors
{"ketama": True, "ketama_weighted": True} writes keys to real memcached servers, and each server
is then asked directly which keys it holds. The Rust test (src/ring.rs via tests/it/cluster.rs)
checks newcache's placement against this file; it needs no server.

    python3 -m venv /tmp/kv && /tmp/kv/bin/pip install pylibmc pymemcache
    /tmp/kv/bin/python tests/data/ketama_vectors.py > tests/data/ketama_vectors.json

Servers on port 11211 are named without the port by ketama ("host-i"), others "host:port-i",
so both are covered: 127.0.0.2-4 on 11211 (loopback addresses; Linux routes all of 127/8 to lo)
and 127.0.0.1 on fixed ports. Run as root or as a user memcached accepts.
"""
import json
import os
import socket
import subprocess
import sys
import time

import pylibmc
from pymemcache.client.base import Client as Raw

CONFIGS = [
    # name, [(host, port, weight)]
    ("three on 11211", [("127.0.0.2", 11211, 1), ("127.0.0.3", 11211, 1), ("127.0.0.4", 11211, 1)]),
    ("two on other ports", [("127.0.0.1", 21211, 1), ("127.0.0.1", 21212, 1)]),
    ("weighted, mixed ports", [("127.0.0.2", 11211, 3), ("127.0.0.3", 11211, 1), ("127.0.0.1", 21211, 2)]),
    ("four, one removed", [("127.0.0.2", 11211, 1), ("127.0.0.3", 11211, 1), ("127.0.0.1", 21212, 1)]),
]

KEYS = [f"key:{i}" for i in range(400)] + [
    # derived-key shapes newcache sends, and a few odd ones
    "prod-1-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33",
    "-1-0beec7b5ea3f0fdbc95d0dd47f3c5bc275da8a33",
    "a", "zz", "user:42:profile", "ünïcode",
]


def start(host, port):
    user = ["-u", "root"] if os.geteuid() == 0 else []
    p = subprocess.Popen(["memcached", "-l", host, "-p", str(port), "-U", "0", *user])
    deadline = time.time() + 5
    while True:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return p
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)


def main():
    out = {
        "generator": "tests/data/ketama_vectors.py",
        "client": f"pylibmc {pylibmc.__version__}, libmemcached {pylibmc.libmemcached_version}",
        "behaviors": {"ketama": True, "ketama_weighted": True},
        "configs": [],
    }
    for name, servers in CONFIGS:
        procs = [start(h, p) for h, p, _ in servers]
        try:
            # pylibmc reads "host:port:weight"
            mc = pylibmc.Client([f"{h}:{p}:{w}" for h, p, w in servers],
                                behaviors={"ketama": True, "ketama_weighted": True})
            for k in KEYS:
                assert mc.set(k.encode(), b"1"), k
            placement = {}
            for i, (h, p, _) in enumerate(servers):
                raw = Raw((h, p))
                for k in KEYS:
                    if raw.get(k.encode()) is not None:
                        assert k not in placement, f"{k} on two servers"
                        placement[k] = i
                raw.close()
            missing = [k for k in KEYS if k not in placement]
            assert not missing, missing
            out["configs"].append({
                "name": name,
                "servers": [{"host": h, "port": p, "weight": w} for h, p, w in servers],
                "placement": placement,
            })
        finally:
            for pr in procs:
                pr.kill()
                pr.wait()
    json.dump(out, sys.stdout, indent=1, ensure_ascii=False)
    print()


if __name__ == "__main__":
    main()
