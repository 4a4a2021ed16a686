#!/usr/bin/env bash
# Alternates main's and the merged branch's binaries: floor (every path) and hot (pipelined_sync threads, AsyncCache).
set -u
cd /tmp/m22
for i in 1 2; do
  for side in main new; do
    [ $i = 2 ] && { [ $side = main ] && side=new || side=main; }
    echo "== floor $side run $i load $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%T)" >> log.txt
    /tmp/$side-bins/floor --rounds 9 --json floor-$side-$i.json > floor-$side-$i.txt 2> floor-$side-$i.err
    tail -12 floor-$side-$i.err >> log.txt
  done
done
for i in 1 2 3; do
  for side in main new; do
    [ $i = 2 ] && { [ $side = main ] && side=new || side=main; }
    echo "== hot $side run $i load $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%T)" >> log.txt
    /tmp/$side-bins/hot --client newcache-threads --client async-cache --concurrency 64 --concurrency 256 --rounds 1 --duration 4 --table hot-$side-$i.table > hot-$side-$i.jsonl 2> hot-$side-$i.err
    cat hot-$side-$i.table >> log.txt
  done
done
echo done >> log.txt
