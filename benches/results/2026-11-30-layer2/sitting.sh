#!/usr/bin/env bash
# The sixth sitting of 2026-11-30 (issue 11, the response layer at 0.8x /static): what ran, in
# this order, on a quiet machine (no build or helper running during a run). From the repository
# root:
#
#   bash benches/results/2026-11-30-layer2/sitting.sh
#
# 1. the web service under wrk, separate runs of ROUNDS=5 interleaved rounds of /static and
#    /page/1 (webapp-final at ffe30b7, webapp-final2 and webapp-final3 at 9b78762, webapp-final4 at
#    2fabb5e after the last review's fix; webapp-ca52dc1 is an earlier run, at the sitting's first
#    commit);
# 2. the response cache's hit path next to its origin (benches/layer.rs);
# 3. the memory backend's footprint (benches/memory.rs).
set -euo pipefail
here=benches/results/2026-11-30-layer2
for run in webapp-final webapp-final2 webapp-final3 webapp-final4; do
    ROUNDS=5 bash benches/webapp/run.sh "$here/$run"
done
cargo bench --features tower --bench layer 2>&1 | grep -B1 -A1 "time:" > "$here/layer.txt"
cargo bench --bench memory 2>&1 | tail -4 > "$here/memory.txt"
