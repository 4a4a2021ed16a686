# 2026-11-30: copy of 2026-11-29/summarize.py (ops part unchanged); stampede tables and checks appended at the end.
import json, re, sys
def crit(path):
    out = {}; name = None
    for l in open(path):
        m = re.match(r'^(memcached/\S+)', l)
        if m: name = m.group(1)
        t = re.search(r'time:\s+\[(\S+) (\S+) (\S+) (\S+) (\S+) (\S+)\]', l)
        if t and name:
            v, unit = float(t.group(3)), t.group(4)
            out[name] = v * (1000 if unit == 'ms' else 1)
            name = None
    return out
def py(path):
    rows = [json.loads(l) for l in open(path) if l.startswith('{')]
    return {(r['peer'], r['op']): r for r in rows}
for tag in 'ab':
    rs = crit(f'rs-ops-{tag}.txt'); p = py(f'py-ops-{tag}.jsonl')
    print(f"\n### ops sitting {tag}: median per call (µs), calls/s in brackets")
    ops = ['get_hit', 'get_miss', 'set', 'get_many_100', 'set_many_100']
    pyops = ['get_hit', 'get_miss', 'set', 'get_many', 'set_many']
    print('| client | ' + ' | '.join(ops) + ' |'); print('|---|' + '---|' * len(ops))
    for c in ['newcache', 'memcache-crate', 'bare-socket']:
        cells = []
        for o in ops:
            v = rs.get(f'memcached/{o}/{c}')
            cells.append(f'{v:.1f} ({1e6/v:,.0f}/s)' if v else '-')
        print(f'| rust {c} | ' + ' | '.join(cells) + ' |')
    for peer in ['raw_pymemcache', 'raw_python_memcached', 'django_pymemcache', 'newcache', 'dogpile']:
        cells = []
        for o in pyops:
            r = p.get((peer, o))
            cells.append(f"{r['p50_us']:.0f} ({r['ops_per_s']:,.0f}/s)" if r else '-')
        print(f'| py {peer} | ' + ' | '.join(cells) + ' |')
    # ratios
    def calls(c, o): return 1e6 / rs[f'memcached/{o}/{c}']
    print('\nratios:')
    for o in ops:
        print(f"  {o}: newcache/crate time {rs[f'memcached/{o}/newcache']/rs[f'memcached/{o}/memcache-crate']:.3f}, newcache/bare {rs[f'memcached/{o}/newcache']/rs[f'memcached/{o}/bare-socket']:.3f}")
    gm = calls('newcache', 'get_many_100')
    for peer in ['raw_pymemcache', 'django_pymemcache', 'newcache']:
        print(f"  get_many calls/s vs py {peer}: {gm / p[(peer,'get_many')]['ops_per_s']:.2f}x")

# --- added 2026-11-30: stampede tables (py peers and newcache-rs modes, every raw line) ---
def stamp(path):
    try:
        return [json.loads(l) for l in open(path) if l.startswith('{')]
    except FileNotFoundError:
        return []
for title, files in [('warm (10 s)', ['py-stampede-warm.jsonl', 'rs-stampede-warm.jsonl']),
                     ('cold (3 s)', ['py-stampede-cold.jsonl', 'rs-stampede-cold.jsonl']),
                     ('cold short (1.9 s)', ['rs-stampede-cold-short.jsonl'])]:
    print(f"\n### stampede {title}")
    print('| peer | loads | expiries | loads/expiry mean (max) | bursts | reads/s | caller loads | stalled | p50 ms | p99 ms | max ms | stale served | errors | bad |')
    print('|---|' + '---|' * 13)
    for f in files:
        for r in stamp(f):
            pre = 'rs ' if f.startswith('rs') else 'py '
            print(f"| {pre}{r['peer']} | {r['loads_total']} | {r['expiries']} | {r['loads_per_expiry']} ({r['loads_per_expiry_max']}) "
                  f"| {r.get('bursts')} | {r['reads_per_s']:,.0f} | {r['caller_loads']} | {r['stalled_reads']} | {r['p50_ms']} | {r['p99_ms']} "
                  f"| {r['max_ms']} | {r.get('stale_served', '-')} | {r.get('errors', '-')} | {r['bad_reads']} |")
    # checks on newcache's own modes
    for f in files:
        for r in stamp(f):
            if not f.startswith('rs'):
                continue
            m = r.get('mode')
            notes = []
            if r.get('errors', 0) or r['bad_reads']:
                notes.append('ERRORS/BAD READS')
            if m in ('default', 'early', 'background', 'newcache') and r['loads_per_expiry_max'] > 1:
                notes.append('loaded more than once per expiry')
            if m == 'default' and r['stalled_reads'] != r['loads_total']:
                notes.append(f"stalled {r['stalled_reads']} != loads {r['loads_total']}")
            if m == 'background' and r['stalled_reads'] != 0:
                notes.append(f"background stalled {r['stalled_reads']} != 0")
            if notes:
                cold = ' [cold start: every worker waits on (or runs) the first load, so stalled ~= workers is expected]' if r.get('cold') else ''
                print(f"  CHECK {r['peer']}: {'; '.join(notes)}{cold}")
