#!/usr/bin/env bash
# The fifth sitting of 2026-11-30 (issues 7, 8 and 11): what ran, in this order, on a quiet
# machine (no other build or helper running). From the repository root:
#
#   bash benches/results/2026-11-30-layer/sitting.sh
#
# 1. get_many(100), RUNS (default 8) separate processes of the memcached bench, each measuring
#    the five get_many_100 clients interleaved with a partner; getmany.py reads them;
# 2. the response cache's hit path next to its origin (benches/layer.rs);
# 3. the web service under wrk, ROUNDS=5 interleaved rounds of /static and /page/1.
set -euo pipefail
here=benches/results/2026-11-30-layer
runs=${RUNS:-8}
cargo bench --bench memcached --no-run 2>/dev/null
cargo bench --features tower --bench layer --no-run 2>/dev/null
git rev-parse HEAD > "$here/commit"
for i in $(seq "$runs"); do
    cargo bench --bench memcached -- "^memcached/get_many_100/" > "$here/getmany-$i.txt" 2>&1
done
python3 "$here/getmany.py" "$here"/getmany-*.txt | tee "$here/getmany.md"
cargo bench --features tower --bench layer > "$here/layer.txt" 2>&1
ROUNDS=5 bash benches/webapp/run.sh "$here/webapp"
