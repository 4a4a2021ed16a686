#!/bin/sh
# 2026-12-07c: newcache's 64 tasks (side 1) against the minimal client (side 4), each side run
# alone (`--only-side`), so that this process's counters are that side's. Run from the project
# root after `cargo build --release -p newcache-bench -- floorbins`.
set -e
out=benches/results/2026-12-07c
F=target/release/bench floor
# System calls by process (619,008 gets: 3 rounds of 199,680 and a warm-up of 19,968; the
# setup adds about 3,600 each of sendto, recvfrom and memcached's sendmsg and read, the same on
# every side). The memcached the floor starts are its children, which `perf stat` would count
# too: each call is recorded, then counted by thread name (memcached's are `memcached` and
# `mc-*`). raw_syscalls:sys_enter counts every call; epoll_wait's with a zero timeout (a check
# that does not sleep) are counted apart. Side 6 is the minimal client without its sockets.
for i in 1 2; do
  for side in 1 4 6; do
    perf record -q -o /tmp/pr-$side-$i.data \
      -e raw_syscalls:sys_enter,syscalls:sys_enter_sendto,syscalls:sys_enter_recvfrom,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_futex,syscalls:sys_enter_write,syscalls:sys_enter_read,syscalls:sys_enter_sendmsg,syscalls:sys_enter_sched_yield \
      $F --rounds 3 --path async-get-64 --only-side $side > /dev/null 2> $out/pr-$side-$i.err
    perf script -i /tmp/pr-$side-$i.data -F comm,event,trace 2>/dev/null \
      | awk '{ who = ($1 == "memcached" || $1 ~ /^mc-/) ? "memcached" : "client"
               ev = $2; sub(/:$/, "", ev); n[who " " ev]++
               if (ev ~ /epoll_wait/ && $0 ~ /timeout: 0x00000000/) n[who " " ev "(timeout 0)"]++ }
             END { for (k in n) print k, n[k] }' | sort > $out/pr-$side-$i.counts
  done
done
# The same runs with no profiler: CPU, times put on a CPU, and this process's user and system
# time a get (the .err files' side lines).
for i in 1 2; do
  for side in 1 4; do
    $F --rounds 3 --path async-get-64 --only-side $side > /dev/null 2> $out/us-$side-$i.err
  done
done
# Instructions a get (callgrind): the difference of two runs, 10,944 and 32,896 gets; also the
# facade alone (side 5) and the minimal client without its sockets (side 6).
for side in 1 4 5 6; do
  for ops in 1000 3000; do
    valgrind --tool=callgrind --callgrind-out-file=/tmp/cg-$side-$ops.out $F --rounds 1 --slices 1 \
      --ops $ops --path async-get-64 --only-side $side > /dev/null 2> $out/cg-$side-$ops.err
    callgrind_annotate --threshold=100 /tmp/cg-$side-$ops.out | grep -E '^ *[0-9,]+ \(' > $out/cg-$side-$ops.functions
  done
done
