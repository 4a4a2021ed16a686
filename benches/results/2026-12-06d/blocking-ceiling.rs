// Experiment (2026-12-06d): the 64-task batching ceiling on a blocking thread (std sockets, no
// reactor), shapes 1xDxK, against one memcached; 1,000 keys of 48 bytes, 130-byte values.
// rustc -O -o /tmp/blk blocking-ceiling.rs && /tmp/blk 127.0.0.1:PORT  (memcached -t 2)
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Instant;
fn main() {
    let addr = std::env::args().nth(1).unwrap();
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_nodelay(true).unwrap();
    let keys: Vec<String> = (0..1000).map(|i| format!("{:048}", i)).collect();
    let val = vec![b'v'; 130];
    for k in &keys {
        s.write_all(format!("set {k} 0 0 130\r\n").as_bytes()).unwrap();
        s.write_all(&val).unwrap();
        s.write_all(b"\r\n").unwrap();
        let mut r = BufReader::new(&s);
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        assert_eq!(l, "STORED\r\n");
    }
    let reply_len = |_k: &str| format!("VALUE {} 0 130\r\n", "x".repeat(48)).len() + 132;
    let mut rng = 0x5EEDu64;
    let mut next = || { rng = rng.wrapping_add(0x9E3779B97F4A7C15); let mut z = rng; z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9); z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB); ((z ^ (z >> 31)) % 1000) as usize };
    for (depth, per) in [(2usize, 32usize), (4, 16), (8, 8), (4, 16), (2, 32), (8, 8)] {
        let gets = 1_000_000usize;
        let lines = gets / per;
        let mut buf = vec![0u8; 1 << 20];
        let (mut have, mut sent) = (0usize, 0usize);
        let mut pending = std::collections::VecDeque::new();
        let mut line = Vec::new();
        let t = Instant::now();
        let mut send = |s: &mut TcpStream, pending: &mut std::collections::VecDeque<usize>| {
            line.clear(); line.extend_from_slice(b"get"); let mut len = 5;
            for _ in 0..per { let i = next(); line.push(b' '); line.extend_from_slice(keys[i].as_bytes()); len += reply_len(&keys[i]); }
            line.extend_from_slice(b"\r\n"); s.write_all(&line).unwrap(); pending.push_back(len);
        };
        for _ in 0..depth { send(&mut s, &mut pending); sent += 1; }
        while let Some(len) = pending.pop_front() {
            while have < len { let n = s.read(&mut buf[have..]).unwrap(); assert!(n > 0); have += n; }
            assert!(buf[..len].ends_with(b"END\r\n"));
            buf.copy_within(len..have, 0); have -= len;
            if sent < lines { send(&mut s, &mut pending); sent += 1; }
        }
        let el = t.elapsed().as_secs_f64();
        println!("blocking thread 1x{depth}x{per}: {:.0} gets/s", (lines * per) as f64 / el);
    }
}
