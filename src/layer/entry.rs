//! What the response cache stores under a key, and its byte layout: a page (status, headers, and
//! the body copied in whole, last, so it lies contiguous in the item), a page's vary record (the
//! header names its variants are keyed on, and their generation), or a hit-for-pass marker.
//! Stored as a raw payload (no codec), through the loader like any value. Pure.

use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http::header::{HeaderMap, HeaderName, HeaderValue};

use crate::codec::{Codec, Decode, Encode, Format, Payload};
use crate::error::{Error, Result};

const MAGIC: [u8; 2] = *b"NP";
/// Version 2 added a page's "never stale" flag and a vary record's generation; version 1
/// entries are still read (not stale-forbidding, generation 0).
const VERSION: u8 = 2;

/// One stored response.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Page {
    pub(crate) status: StatusCode,
    /// The response's headers, less hop-by-hop ones and `Age` (recomputed when served).
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    /// Whether a request carrying `Authorization` may be served it.
    pub(crate) shared: bool,
    /// Whether it must never be served past its freshness (`must-revalidate`,
    /// `proxy-revalidate`, `s-maxage`): stored without the herd's grace.
    pub(crate) no_stale: bool,
    /// The `Age` the origin's response carried, in seconds.
    pub(crate) origin_age: u32,
}

/// What the response cache keeps under a page or variant key.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Body {
    Page(Page),
    /// The response varies on these request headers: its variants are stored under variant
    /// keys that hold `generation` (random, new with every record), so that a record stored
    /// again, or a page invalidated, leaves the old variants unreachable.
    Vary {
        names: Vec<HeaderName>,
        generation: u64,
    },
    /// The last response was not storable: requests go to the origin at once.
    Pass,
}

/// A stored thing, with when it was stored and how long it is fresh (by the cache's clock).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Entry {
    pub(crate) stored_ms: u64,
    /// How long it is fresh; zero: not to be stored (the loader stores nothing).
    pub(crate) fresh: Duration,
    pub(crate) body: Body,
}

impl Entry {
    /// Whether it is past its freshness lifetime at `now_ms` (served while being refreshed).
    pub(crate) fn is_stale(&self, now_ms: u64) -> bool {
        now_ms >= self.stored_ms.saturating_add(self.fresh.as_millis() as u64)
    }

    /// How old it is at `now_ms`, in seconds, counting the origin's own `Age`.
    pub(crate) fn age_secs(&self, now_ms: u64) -> u64 {
        let here = now_ms.saturating_sub(self.stored_ms) / 1000;
        match &self.body {
            Body::Page(p) => here + u64::from(p.origin_age),
            _ => here,
        }
    }

    /// The bytes of an entry (the payload under the cache's envelope).
    pub(crate) fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&self.stored_ms.to_le_bytes());
        out.extend_from_slice(&(self.fresh.as_millis() as u64).to_le_bytes());
        match &self.body {
            Body::Pass => out.push(0),
            Body::Vary { names, generation } => {
                out.push(1);
                out.extend_from_slice(&(names.len() as u16).to_le_bytes());
                for n in names {
                    put_short(out, n.as_str().as_bytes());
                }
                out.extend_from_slice(&generation.to_le_bytes());
            }
            Body::Page(p) => {
                out.push(2);
                out.extend_from_slice(&p.status.as_u16().to_le_bytes());
                out.push(u8::from(p.shared) | (u8::from(p.no_stale) << 1));
                out.extend_from_slice(&p.origin_age.to_le_bytes());
                out.extend_from_slice(&(p.headers.len() as u32).to_le_bytes());
                for (name, value) in &p.headers {
                    put_short(out, name.as_str().as_bytes());
                    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
                    out.extend_from_slice(value.as_bytes());
                }
                // The body last, in one copy: the rest of the item.
                out.extend_from_slice(&p.body);
            }
        }
    }

    /// Reads an entry's bytes; anything malformed is a decode error. A page's header values and
    /// body are slices of `bytes`, not copies.
    pub(crate) fn read(bytes: &Bytes) -> Result<Entry> {
        let mut r = Reader(bytes);
        if r.take(2)? != MAGIC {
            return Err(Error::decode("not a response-cache entry"));
        }
        let version = r.u8()?;
        if version != 1 && version != VERSION {
            return Err(Error::decode("not a response-cache entry of this version"));
        }
        let stored_ms = r.u64()?;
        let fresh = Duration::from_millis(r.u64()?);
        let body = match r.u8()? {
            0 => Body::Pass,
            1 => {
                let n = r.u16()?;
                let mut names = Vec::with_capacity(usize::from(n).min(64));
                for _ in 0..n {
                    let len = usize::from(r.u16()?);
                    names.push(HeaderName::from_bytes(r.take(len)?).map_err(bad)?);
                }
                let generation = if version == 1 { 0 } else { r.u64()? };
                Body::Vary { names, generation }
            }
            2 => {
                let status = StatusCode::from_u16(r.u16()?).map_err(bad)?;
                let flags = r.u8()?;
                let (shared, no_stale) = if version == 1 {
                    (flags != 0, false)
                } else {
                    (flags & 1 != 0, flags & 2 != 0)
                };
                let origin_age = r.u32()?;
                let n = r.u32()?;
                // Room for the two the cache adds when it serves the page (`Age`, `X-Cache`).
                let mut headers = HeaderMap::with_capacity((n as usize).min(64) + 2);
                for _ in 0..n {
                    let len = usize::from(r.u16()?);
                    let name = HeaderName::from_bytes(r.take(len)?).map_err(bad)?;
                    let len = r.u32()? as usize;
                    let value = HeaderValue::from_maybe_shared(bytes.slice_ref(r.take(len)?))
                        .map_err(bad)?;
                    headers.append(name, value);
                }
                Body::Page(Page {
                    status,
                    headers,
                    body: bytes.slice_ref(r.0),
                    shared,
                    no_stale,
                    origin_age,
                })
            }
            k => {
                return Err(Error::decode(format!(
                    "unknown response-cache entry kind {k}"
                )));
            }
        };
        Ok(Entry {
            stored_ms,
            fresh,
            body,
        })
    }
}

fn bad(e: impl std::fmt::Display) -> Error {
    Error::decode(format!("a malformed response-cache entry: {e}"))
}

fn put_short(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
    out.extend_from_slice(bytes);
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(Error::decode("a truncated response-cache entry"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
}

impl Encode for Entry {
    fn encode_payload(&self, _: &Format, out: &mut Vec<u8>) -> Result<Payload> {
        self.write(out);
        Ok(Payload::Raw)
    }
    fn lifetime(&self) -> Option<Duration> {
        Some(self.fresh)
    }
    fn serve_stale(&self) -> bool {
        !matches!(&self.body, Body::Page(p) if p.no_stale)
    }
}

impl Decode for Entry {
    fn decode_payload(
        _: &Format,
        _: Codec,
        how: Payload,
        item: &Bytes,
        payload: &[u8],
    ) -> Result<Entry> {
        raw_only(how)?;
        Entry::read(&item.slice_ref(payload))
    }
}

/// An entry is stored raw: a codec's value under its key is not one.
fn raw_only(how: Payload) -> Result<()> {
    if how != Payload::Raw {
        return Err(Error::decode(
            "the stored value is a codec's, not a response-cache entry",
        ));
    }
    Ok(())
}

/// An entry read on the at-once path (a hit on a backend that answers at once: the memory
/// backend), through a memo of the last entries this thread read there.
///
/// The memo keeps, for each entry it read, its own copy of the payload it was read from, and
/// the entry read from that copy. A payload with the same bytes is the same entry (its bytes
/// are all an entry is), so the remembered entry is cloned instead of having its headers
/// parsed, checked and hashed again: a hot page is read once per thread. The clone's header
/// values and body are slices of the thread's own copy, so a hit on another core does not
/// touch their reference count. The memo holds no handle on the backend's items: what it keeps
/// alive is its copies, at most [`MEMO_SLOTS`] payloads of at most [`MEMO_MAX_PAYLOAD`] bytes
/// per thread (and the entries read from them), the least recently used pushed out first. A
/// replaced or invalidated page may stay in a thread's memo, but is served only if the backend
/// returns those very bytes again.
#[derive(Debug)]
pub(crate) struct Recent(pub(crate) Entry);

/// How many entries a thread's memo keeps.
const MEMO_SLOTS: usize = 8;
/// Larger payloads are read each time, never copied into a memo: a hit compares the whole
/// payload, and for a large one that costs more than reading its headers again.
const MEMO_MAX_PAYLOAD: usize = 8 * 1024;

thread_local! {
    static MEMO: std::cell::RefCell<Memo> = const { std::cell::RefCell::new(Memo { slots: Vec::new() }) };
}

struct Memo {
    /// Most recently used first; at most [`MEMO_SLOTS`].
    slots: Vec<Remembered>,
}

struct Remembered {
    /// The memo's own copy of the payload the entry was read from.
    payload: Bytes,
    /// Read from `payload`: its slices are of that copy.
    entry: Entry,
}

impl Memo {
    fn read(&mut self, payload: &[u8]) -> Result<Entry> {
        if let Some(i) = self.slots.iter().position(|r| r.payload[..] == *payload) {
            self.slots[..=i].rotate_right(1);
            return Ok(self.slots[0].entry.to_serve());
        }
        let copy = Bytes::copy_from_slice(payload);
        let entry = Entry::read(&copy)?;
        let served = entry.to_serve();
        self.slots.truncate(MEMO_SLOTS - 1);
        self.slots.insert(
            0,
            Remembered {
                payload: copy,
                entry,
            },
        );
        Ok(served)
    }
}

impl Entry {
    /// A copy of this entry, a page's headers with room for the two the cache adds when it
    /// serves it (`Age`, `X-Cache`), as [`read`](Entry::read) leaves them: a clone's would be
    /// full, and grow (a reallocation) on the first insert.
    fn to_serve(&self) -> Entry {
        let body = match &self.body {
            Body::Page(p) => {
                let mut headers = HeaderMap::with_capacity(p.headers.len() + 2);
                for (name, value) in &p.headers {
                    headers.append(name.clone(), value.clone());
                }
                Body::Page(Page {
                    headers,
                    body: p.body.clone(),
                    ..*p
                })
            }
            other => other.clone(),
        };
        Entry { body, ..*self }
    }
}

impl Decode for Recent {
    fn decode_payload(
        _: &Format,
        _: Codec,
        how: Payload,
        item: &Bytes,
        payload: &[u8],
    ) -> Result<Recent> {
        raw_only(how)?;
        if payload.len() <= MEMO_MAX_PAYLOAD {
            // No memo while the thread's locals are being destroyed, nor (it cannot happen:
            // nothing it runs reads the cache) within a read of it: then read as any entry.
            let remembered = MEMO.try_with(|memo| {
                memo.try_borrow_mut()
                    .map(|mut memo| memo.read(payload))
                    .ok()
            });
            if let Ok(Some(read)) = remembered {
                return read.map(Recent);
            }
        }
        Entry::read(&item.slice_ref(payload)).map(Recent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn round_trip(e: Entry) {
        let mut buf = Vec::new();
        e.write(&mut buf);
        let buf = Bytes::from(buf);
        assert_eq!(Entry::read(&buf).unwrap(), e);
        // Every truncation is an error, never a panic or a shorter entry (but a page's body
        // may end anywhere).
        for n in 0..buf.len() {
            if let Ok(short) = Entry::read(&buf.slice(..n)) {
                assert!(matches!(short.body, Body::Page(_)), "{n}");
            }
        }
    }

    #[test]
    fn entries_round_trip() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("text/html"));
        headers.append("link", HeaderValue::from_static("</a>"));
        headers.append("link", HeaderValue::from_static("</b>"));
        round_trip(Entry {
            stored_ms: 1_700_000_000_000,
            fresh: Duration::from_secs(60),
            body: Body::Page(Page {
                status: StatusCode::OK,
                headers,
                body: Bytes::from_static(b"<html>hello</html>"),
                shared: true,
                no_stale: true,
                origin_age: 7,
            }),
        });
        round_trip(Entry {
            stored_ms: 1,
            fresh: Duration::from_secs(5),
            body: Body::Vary {
                names: vec![http::header::ACCEPT, http::header::ACCEPT_LANGUAGE],
                generation: 0x0123_4567_89ab_cdef,
            },
        });
        round_trip(Entry {
            stored_ms: 1,
            fresh: Duration::from_secs(5),
            body: Body::Pass,
        });
    }

    fn page(body: &'static str) -> Entry {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("text/html"));
        Entry {
            stored_ms: 1,
            fresh: Duration::from_secs(60),
            body: Body::Page(Page {
                status: StatusCode::OK,
                headers,
                body: Bytes::from_static(body.as_bytes()),
                shared: false,
                no_stale: false,
                origin_age: 0,
            }),
        }
    }

    fn recent(item: &Bytes) -> Entry {
        let format = Format::default();
        Recent::decode_payload(&format, Codec::default(), Payload::Raw, item, &item[3..])
            .unwrap()
            .0
    }

    fn body(e: &Entry) -> &Bytes {
        match &e.body {
            Body::Page(p) => &p.body,
            _ => panic!("not a page"),
        }
    }

    /// An item as a backend returns it: three bytes of envelope, then the entry.
    fn item(e: &Entry) -> Bytes {
        let mut buf = b"env".to_vec();
        e.write(&mut buf);
        Bytes::from(buf)
    }

    #[test]
    fn the_memo_reads_an_item_once_and_never_serves_a_replaced_one() {
        let first = item(&page("first"));
        let read = recent(&first);
        assert_eq!(read, page("first"));
        // Read from this thread's copy, not from the item.
        let within = |b: &Bytes, item: &Bytes| {
            let at = b.as_ptr() as usize;
            let start = item.as_ptr() as usize;
            (start..start + item.len()).contains(&at)
        };
        assert!(!within(body(&read), &first));
        // The same item again: the very entry the memo kept (the same copy), equal to a read.
        let again = recent(&first);
        assert_eq!(again, read);
        assert_eq!(body(&again).as_ptr(), body(&read).as_ptr());
        // With room for the two headers a served page gets (a clone would have none).
        for e in [&read, &again] {
            let Body::Page(p) = &e.body else { panic!() };
            assert!(p.headers.capacity() >= p.headers.len() + 2);
        }
        // The same bytes in another item (stored again): read, and equal.
        let copy = Bytes::copy_from_slice(&first);
        assert_eq!(recent(&copy), page("first"));
        // The key written again: the new item is read, whatever the memo holds.
        let second = item(&page("second"));
        assert_eq!(recent(&second), page("second"));
        // More items than the memo has slots: each still reads as itself.
        let items: Vec<Bytes> = ["a", "b", "c", "d", "e", "f"]
            .iter()
            .map(|b| item(&page(b)))
            .collect();
        for _ in 0..2 {
            for (i, b) in items.iter().zip(["a", "b", "c", "d", "e", "f"]) {
                assert_eq!(recent(i), page(b));
            }
        }
        // A malformed item is an error, and is not remembered.
        let bad = Bytes::from_static(b"envNP\x02");
        let format = Format::default();
        for _ in 0..2 {
            assert!(
                Recent::decode_payload(&format, Codec::default(), Payload::Raw, &bad, &bad[3..])
                    .is_err()
            );
        }
        // A codec's value is not an entry.
        assert!(
            Recent::decode_payload(
                &format,
                Codec::default(),
                Payload::Coded,
                &first,
                &first[3..]
            )
            .is_err()
        );
    }

    #[test]
    fn large_payloads_are_read_each_time() {
        static BIG: [u8; MEMO_MAX_PAYLOAD] = [b'x'; MEMO_MAX_PAYLOAD];
        let big = item(&page(std::str::from_utf8(&BIG).unwrap()));
        let a = recent(&big);
        let b = recent(&big);
        assert_eq!(a, b);
        // Not a copy: slices of the item itself, each time.
        assert_eq!(
            body(&a).as_ptr(),
            big[big.len() - MEMO_MAX_PAYLOAD..].as_ptr()
        );
        assert_eq!(body(&b).as_ptr(), body(&a).as_ptr());
    }

    #[test]
    fn the_body_is_the_tail_of_the_bytes() {
        let body = Bytes::from(vec![0xAB; 1000]);
        let e = Entry {
            stored_ms: 1,
            fresh: Duration::from_secs(1),
            body: Body::Page(Page {
                status: StatusCode::OK,
                headers: HeaderMap::new(),
                body: body.clone(),
                shared: false,
                no_stale: false,
                origin_age: 0,
            }),
        };
        let mut buf = Vec::new();
        e.write(&mut buf);
        assert!(buf.ends_with(&body));
    }

    #[test]
    fn version_1_entries_are_still_read() {
        let mut v1 = Vec::new();
        v1.extend_from_slice(b"NP\x01");
        v1.extend_from_slice(&1u64.to_le_bytes());
        v1.extend_from_slice(&5000u64.to_le_bytes());
        v1.push(1);
        v1.extend_from_slice(&1u16.to_le_bytes());
        put_short(&mut v1, b"accept");
        let e = Entry::read(&Bytes::from(v1)).unwrap();
        assert_eq!(
            e.body,
            Body::Vary {
                names: vec![http::header::ACCEPT],
                generation: 0
            }
        );
        let mut v1 = Vec::new();
        v1.extend_from_slice(b"NP\x01");
        v1.extend_from_slice(&1u64.to_le_bytes());
        v1.extend_from_slice(&5000u64.to_le_bytes());
        v1.push(2);
        v1.extend_from_slice(&200u16.to_le_bytes());
        v1.push(1);
        v1.extend_from_slice(&0u32.to_le_bytes());
        v1.extend_from_slice(&0u32.to_le_bytes());
        v1.extend_from_slice(b"body");
        let Body::Page(p) = Entry::read(&Bytes::from(v1)).unwrap().body else {
            panic!("a page")
        };
        assert!(p.shared && !p.no_stale);
        assert_eq!(p.body, "body");
    }

    #[test]
    fn staleness_and_age() {
        let e = Entry {
            stored_ms: 10_000,
            fresh: Duration::from_secs(2),
            body: Body::Pass,
        };
        assert!(!e.is_stale(11_999));
        assert!(e.is_stale(12_000));
        assert_eq!(e.age_secs(13_500), 3);
        assert_eq!(e.age_secs(9_000), 0, "a clock behind the writer's");
    }

    // ---- The at-once memo: what it keeps alive, what it remembers, what it decodes. ----

    /// A page whose item (three bytes of envelope, then the entry) is exactly `len` bytes long.
    fn item_of_len(fill: u8, len: usize) -> Bytes {
        let with = |n: usize| {
            let mut e = page("");
            if let Body::Page(p) = &mut e.body {
                p.body = Bytes::from(vec![fill; n]);
            }
            item(&e)
        };
        let overhead = with(0).len();
        let it = with(len - overhead);
        assert_eq!(it.len(), len);
        it
    }

    /// The memo keeps no handle on the items it read (a backend's stored buffer stays the
    /// backend's, even if the memo was built to hold each item), and at most [`MEMO_SLOTS`]
    /// copies of at most [`MEMO_MAX_PAYLOAD`] bytes, which the remembered entries' slices are of.
    #[test]
    fn the_memo_keeps_no_more_than_its_documented_bytes_alive() {
        let items: Vec<Bytes> = (0..MEMO_SLOTS + 2)
            .map(|i| item_of_len(b'a' + i as u8, MEMO_MAX_PAYLOAD + 3))
            .collect();
        for it in &items {
            let read = recent(it);
            assert_eq!(read, Entry::read(&it.slice(3..)).unwrap());
        }
        for it in &items {
            assert!(it.is_unique(), "the memo holds no item it read");
        }
        let held = MEMO.with(|m| {
            let m = m.borrow();
            assert_eq!(m.slots.len(), MEMO_SLOTS);
            let mut held = 0;
            for r in &m.slots {
                let b = body(&r.entry);
                let start = r.payload.as_ptr() as usize;
                assert!((start..start + r.payload.len()).contains(&(b.as_ptr() as usize)));
                held += r.payload.len();
            }
            held
        });
        assert!(
            held <= MEMO_SLOTS * MEMO_MAX_PAYLOAD,
            "a thread's memo keeps {held} bytes alive, documented bound {}",
            MEMO_SLOTS * MEMO_MAX_PAYLOAD
        );
    }

    /// A hot page stays remembered whatever else is read between its hits (a first in, first
    /// out memo would let four pages read once push out a page read between every one of them).
    #[test]
    fn a_page_read_between_every_other_stays_remembered() {
        let hot = item(&page("hot"));
        let first = recent(&hot);
        for n in 0..3 * MEMO_SLOTS {
            let cold = item(&page(
                ["c1", "c2", "c3", "c4", "c5", "c6", "c7", "c8", "c9"][n % 9],
            ));
            drop(recent(&cold));
            let again = recent(&hot);
            assert_eq!(
                body(&again).as_ptr(),
                body(&first).as_ptr(),
                "the hot page (read {} times) was read again after {} pages read once",
                n + 2,
                n + 1
            );
        }
    }

    /// Entry's own decode works whatever the thread's state; the memo's `MEMO.with` panics
    /// ("cannot access a Thread Local Storage value during or after destruction") once the
    /// memo's thread-local has been destroyed, e.g. for a request made from another
    /// thread-local's destructor at thread exit (destructors run last-registered first). A
    /// panic there, uncaught, aborts the process.
    #[test]
    fn an_at_once_read_works_while_thread_locals_are_destroyed() {
        use std::sync::atomic::{AtomicU8, Ordering};
        // 0: not run; 1: Entry read; 2: Entry panicked; +10: Recent read; +20: Recent panicked.
        static OUTCOME: AtomicU8 = AtomicU8::new(0);
        struct LateReader;
        impl Drop for LateReader {
            fn drop(&mut self) {
                let it = item(&page("late"));
                let format = Format::default();
                let entry = std::panic::catch_unwind(|| {
                    Entry::decode_payload(&format, Codec::default(), Payload::Raw, &it, &it[3..])
                        .unwrap()
                });
                let memo = std::panic::catch_unwind(|| recent(&it));
                let code = if entry.is_ok() { 1 } else { 2 } + if memo.is_ok() { 10 } else { 20 };
                OUTCOME.store(code, Ordering::SeqCst);
            }
        }
        thread_local! {
            static LATE: LateReader = const { LateReader };
        }
        std::thread::spawn(|| {
            // Registered first, so destroyed after the memo (registered by the read below).
            LATE.with(|_| {});
            drop(recent(&item(&page("early"))));
        })
        .join()
        .unwrap();
        assert_eq!(
            OUTCOME.load(Ordering::SeqCst),
            11,
            "1x: Entry's decode worked; x1: the memo's worked (x2: it panicked)"
        );
    }
    // ---- The memo's order of slots and its size limit. ----

    fn order() -> Vec<Bytes> {
        MEMO.with(|m| m.borrow().slots.iter().map(|r| r.payload.clone()).collect())
    }

    fn pages(n: usize) -> Vec<Bytes> {
        (0..n)
            .map(|i| {
                let mut e = page("");
                if let Body::Page(p) = &mut e.body {
                    p.body = Bytes::from(format!("page {i}"));
                }
                item(&e)
            })
            .collect()
    }

    #[test]
    fn a_hit_at_every_position_moves_to_the_front_and_keeps_the_rest_in_order() {
        for at in 0..MEMO_SLOTS {
            MEMO.with(|m| m.borrow_mut().slots.clear());
            let items = pages(MEMO_SLOTS);
            for it in &items {
                drop(recent(it));
            }
            // Most recent first.
            let mut expect: Vec<Bytes> = items.iter().rev().map(|i| i.slice(3..)).collect();
            assert_eq!(order(), expect);
            let hit = expect.remove(at);
            expect.insert(0, hit);
            let it = &items[MEMO_SLOTS - 1 - at];
            assert_eq!(recent(it), Entry::read(&it.slice(3..)).unwrap());
            assert_eq!(order(), expect, "a hit at {at}");
            // A new one pushes out the last.
            let new = item(&page("new"));
            drop(recent(&new));
            expect.pop();
            expect.insert(0, new.slice(3..));
            assert_eq!(order(), expect, "a new page after a hit at {at}");
        }
    }

    #[test]
    fn a_payload_of_exactly_the_limit_is_remembered_one_byte_more_is_not() {
        let at = item_of_len(b'q', MEMO_MAX_PAYLOAD + 3);
        let over = item_of_len(b'r', MEMO_MAX_PAYLOAD + 4);
        let a = recent(&at);
        assert_eq!(a, Entry::read(&at.slice(3..)).unwrap());
        assert_eq!(order(), vec![at.slice(3..)]);
        let o = recent(&over);
        assert_eq!(o, Entry::read(&over.slice(3..)).unwrap());
        assert_eq!(
            order(),
            vec![at.slice(3..)],
            "a payload over the limit is not kept"
        );
        assert_eq!(
            body(&o).as_ptr(),
            over[over.len() - body(&o).len()..].as_ptr()
        );
    }

    #[test]
    fn a_served_entry_changed_by_its_caller_leaves_the_memo_as_it_was() {
        let mut e = page("body");
        if let Body::Page(p) = &mut e.body {
            p.headers.append("x-multi", HeaderValue::from_static("1"));
            p.headers.append("x-multi", HeaderValue::from_static("2"));
        }
        let it = item(&e);
        let mut first = recent(&it);
        if let Body::Page(p) = &mut first.body {
            p.headers
                .insert("x-multi", HeaderValue::from_static("changed"));
            p.headers.insert("age", HeaderValue::from_static("5"));
            p.headers.remove("content-type");
            p.body = Bytes::from_static(b"other");
            p.status = StatusCode::IM_A_TEAPOT;
            p.origin_age = 9;
        }
        first.stored_ms = 99;
        let again = recent(&it);
        assert_eq!(again, e);
        assert_eq!(again, Entry::read(&it.slice(3..)).unwrap());
    }

    #[test]
    fn the_memo_serves_headers_in_the_order_a_fresh_read_does() {
        let mut headers = HeaderMap::new();
        for (n, v) in [
            ("link", "</a>"),
            ("content-type", "text/html"),
            ("link", "</b>"),
            ("x-Custom-Name", "1"),
            ("link", "</c>"),
            ("vary", "accept"),
            ("x-custom-name", "2"),
        ] {
            headers.append(
                HeaderName::from_bytes(n.as_bytes()).unwrap(),
                HeaderValue::from_static(v),
            );
        }
        let e = Entry {
            stored_ms: 1,
            fresh: Duration::from_secs(60),
            body: Body::Page(Page {
                status: StatusCode::OK,
                headers,
                body: Bytes::from_static(b"b"),
                shared: true,
                no_stale: true,
                origin_age: 3,
            }),
        };
        let it = item(&e);
        let listed = |e: &Entry| -> Vec<(String, Vec<u8>)> {
            let Body::Page(p) = &e.body else { panic!() };
            p.headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                .collect()
        };
        let fresh = Entry::read(&it.slice(3..)).unwrap();
        for _ in 0..3 {
            let r = recent(&it);
            assert_eq!(r, fresh);
            assert_eq!(listed(&r), listed(&fresh));
            let Body::Page(p) = &r.body else { panic!() };
            assert!(p.headers.capacity() >= p.headers.len() + 2);
        }
    }

    #[test]
    fn a_decode_error_is_not_remembered_and_leaves_the_order() {
        let items = pages(3);
        for it in &items {
            drop(recent(it));
        }
        let before = order();
        let format = Format::default();
        for bad in [&b"envNP\x02"[..], b"envXX\x02", b"envNP\x09"] {
            let bad = Bytes::copy_from_slice(bad);
            for _ in 0..2 {
                assert!(
                    Recent::decode_payload(
                        &format,
                        Codec::default(),
                        Payload::Raw,
                        &bad,
                        &bad[3..]
                    )
                    .is_err()
                );
            }
        }
        assert_eq!(order(), before);
    }
}
