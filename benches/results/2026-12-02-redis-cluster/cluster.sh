#!/bin/sh
# Starts a 6-node Redis 7 cluster (3 masters, 3 replicas) on 127.0.0.1:41000-41005 in $DIR
# (default /tmp/newcache-bench-cluster), as the tests' fixture does; `cluster.sh stop` stops it.
set -e
DIR=${DIR:-/tmp/newcache-bench-cluster}
PORTS="41000 41001 41002 41003 41004 41005"
if [ "$1" = stop ]; then
  for p in $PORTS; do redis-cli -p $p shutdown nosave 2>/dev/null || true; done
  rm -rf "$DIR"; exit 0
fi
for p in $PORTS; do
  mkdir -p "$DIR/$p"
  (cd "$DIR/$p" && redis-server --port $p --bind 127.0.0.1 --cluster-enabled yes \
    --cluster-config-file nodes.conf --cluster-node-timeout 2000 --repl-diskless-sync-delay 0 \
    --save '' --appendonly no --protected-mode no --loglevel warning --daemonize yes)
done
sleep 0.5
redis-cli --cluster create $(for p in $PORTS; do printf '127.0.0.1:%s ' $p; done) \
  --cluster-replicas 1 --cluster-yes >/dev/null
until redis-cli -p 41000 cluster info | grep -q cluster_state:ok; do sleep 0.2; done
sleep 2
