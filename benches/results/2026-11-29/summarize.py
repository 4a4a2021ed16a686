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
