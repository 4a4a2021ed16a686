//! The herd protocol for one key, as a sans-I/O state machine (as quinn-proto and h2 write their
//! protocol cores): it says what to do next (read, write-then-read, sleep, run the loader, done)
//! and is told what happened. It never touches a socket, a clock or a thread; the sync front end
//! (`loader/`, `cache/read.rs`) drives it, and an async front end drives the same machine.
//!
//! # The protocol
//!
//! - **Read** the key (`gets`). Judge what is there ([`herd::judge`]).
//! - **Fresh**, or **stale under a live claim**: serve it.
//! - **Stale, unclaimed** (or early, by XFetch): *claim* it: `cas` the same item back with this
//!   caller's token and a claim deadline, then read it back on the same connection (one round
//!   trip). The read-back shows the token: this caller holds the key, with the item's current CAS
//!   token. Losers judge the read-back item instead (usually: serve it stale).
//! - **Missing**: `add` a *placeholder* (an envelope with no value, this caller's token and a
//!   deadline), read back on the same connection. The winner loads; everyone else waits.
//! - **Placeholder or over-age value under a live claim**: wait (bounded by `max_wait`), then
//!   read again. **Under a dead claim**: take it over with `cas` (exactly one caller wins).
//! - **Holding the key**: run the loader, renew the claim while it runs (up to `max_load_time`),
//!   then store the result with `cas` against the claim. Anyone who wrote or deleted the key
//!   meanwhile changed its CAS token, so a load never overwrites a newer state.

use std::time::{Duration, Instant};

use crate::backend::{Item, StoreMode, StoreOutcome};
use crate::envelope::{self, Header, Kind, Parsed};
use crate::error::Error;
use crate::herd::{self, Verdict, Xfetch};
use crate::ttl::{self, Lifetime};

/// Lost races in a row before a caller waits instead of retrying at once.
const MAX_RACES: u32 = 4;
/// Extra reads to settle whether a write landed (a lost read-back, a proxy that reordered).
const MAX_REREADS: u32 = 2;
/// First pause between reads while waiting for another caller's load; pauses grow to
/// [`MAX_POLL_MS`].
const FIRST_POLL_MS: u64 = 2;
const MAX_POLL_MS: u64 = 10;

/// What the caller wants from the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `get`: never waits or adds; a claimed stale entry is reported as a miss to recompute.
    Lookup,
    /// `get_or_set_with`: claims or adds a placeholder, waits for other callers' loads.
    Load,
    /// `get_many_or_set_with`: as `Load`, but never waits (a key someone else is loading is
    /// reported [`Found::Busy`]).
    Batch,
}

/// The times the machine is told: the wall clock (for envelope deadlines, shared across
/// processes) and a monotonic one (for this caller's own waits).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Now {
    pub(crate) wall_ms: u64,
    pub(crate) mono_ms: u64,
}

/// The settings a machine runs with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    /// How long a `Lookup` claim lasts (the herd timeout, as in django-newcache).
    pub(crate) herd_ms: u64,
    /// How long a `Load` claim or placeholder lasts without renewal.
    pub(crate) lease_ms: u64,
    /// The longest this caller waits for someone else's load, from its start.
    pub(crate) max_wait_ms: u64,
    /// The longest a holder renews its claim.
    pub(crate) max_load_ms: u64,
    /// XFetch parameters, in `Load` and `Batch` modes.
    pub(crate) xfetch: Option<Xfetch>,
    /// The seed of this caller's wait jitter (from the cache's seeded random source; never
    /// the claim token, which no seed reaches).
    pub(crate) jitter: u64,
    /// The largest value this cache writes under the key (the backend's limit for it). A value
    /// over it (a cache with a larger item size wrote it) is never claimed: neither the claim
    /// nor the value's give-back could be written.
    pub(crate) max_value: usize,
}

/// What to do next.
#[derive(Debug)]
pub(crate) enum Action {
    /// Read the key (`gets`), then [`Machine::on_read`].
    Read,
    /// Write `value` under the key with `mode` and `exptime` (flags: the envelope's), then read
    /// the key back on the same connection, then [`Machine::on_stored`].
    StoreThenRead {
        mode: StoreMode,
        value: Vec<u8>,
        exptime: u32,
    },
    /// Pause this long, then [`Machine::on_wake`].
    Sleep(Duration),
    /// This caller holds the key: run the loader. Boxed: a claimed is rare (a load), and the
    /// action of every read (a hit's `Done`) is moved through each call's future.
    Load(Box<Claimed>),
    /// Finished.
    Done(Found),
}

/// The key, claimed by this caller for a load: the [`Claim`] and the value it claimed.
#[derive(Debug)]
pub(crate) struct Claimed {
    /// The claim to renew while loading and to store the result against.
    pub(crate) claim: Claim,
    /// The value the claimed item holds, when it may be served (a stale value, or a fresh one
    /// claimed early by XFetch).
    pub(crate) value: Option<Servable>,
}

/// A value the machine found that may be served (to every reader, or only to its claimer); the
/// front end decodes `item.value[offset..]`.
#[derive(Debug)]
pub(crate) struct Servable {
    pub(crate) item: Item,
    pub(crate) offset: usize,
    pub(crate) header: Header,
    /// Claimed while still fresh (an XFetch early refresh).
    pub(crate) early: bool,
    /// Past its staleness bound: never served, except by the holder's own
    /// `serve_stale_on_error` when its load fails.
    pub(crate) expired: bool,
}

/// Why a backend refused a write before sending it ([`Machine::on_refused`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Over the item limit (`is_too_large`).
    TooLarge,
    /// A `cas` on a server without CAS (memcached `-C`, `is_unsupported`).
    NoCas,
}

impl Refusal {
    /// The refusal `e` is, if it is one.
    pub(crate) fn of(e: &Error) -> Option<Refusal> {
        if e.is_too_large() {
            Some(Refusal::TooLarge)
        } else if e.is_unsupported() {
            Some(Refusal::NoCas)
        } else {
            None
        }
    }
}

/// How a machine finished.
#[derive(Debug)]
pub(crate) enum Found {
    /// A value to serve; `stale` when past its soft expiry.
    Value { held: Servable, stale: bool },
    /// Nothing to serve. `claimed`: this reader (in `Lookup` mode) claimed the stale entry and
    /// should recompute it.
    Miss { claimed: bool },
    /// Someone else is loading the key (`Lookup` and `Batch` modes).
    Busy,
    /// Waited `max_wait` for someone else's load.
    TimedOut,
    /// The bytes are not a newcache item of this format.
    Foreign(Error),
    /// An item of a newer format (`Lookup` mode): a counted miss.
    Newer,
    /// A "not storable" marker (`Load` and `Batch` modes; `Lookup` reports a miss): load the
    /// key now, unclaimed, without waiting, and store nothing.
    NotStorable,
    /// The backend failed mid-protocol and there is nothing to serve.
    Unavailable,
}

/// The herd protocol for one key and one caller.
#[derive(Debug)]
pub(crate) struct Machine {
    mode: Mode,
    s: Settings,
    token: u64,
    start_mono_ms: u64,
    /// The last item read (what a claim or takeover would replace).
    last: Option<Item>,
    /// What the pending write was for.
    pending: Pending,
    races: u32,
    /// Reads after a write whose read-back did not settle ownership.
    rereads: u32,
    /// A live holder was seen: this caller waits, and never loads while it may be alive.
    saw_holder: bool,
    /// This caller has paused at least once for another caller's load.
    slept: bool,
    /// The value a pending placeholder replaces (a claim that had no room), and whether it was
    /// past its staleness bound: the holder keeps it, and gives it back if its load fails.
    displaced: Option<(Item, bool)>,
    poll_ms: u64,
    jitter: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pending {
    None,
    /// A claim keeping the value (stale, early, or past its bound), lasting until `until_ms`.
    Claim {
        early: bool,
        expired: bool,
        until_ms: u64,
    },
    /// A placeholder (`add`, or `cas` over a dead claim, an over-age value or foreign bytes).
    Placeholder,
}

impl Machine {
    /// A machine for one call; `token` is this caller's (non-zero, unique) claim token.
    pub(crate) fn new(mode: Mode, settings: Settings, token: u64, now: Now) -> Machine {
        Machine {
            mode,
            s: settings,
            token,
            start_mono_ms: now.mono_ms,
            last: None,
            pending: Pending::None,
            races: 0,
            rereads: 0,
            saw_holder: false,
            slept: false,
            displaced: None,
            poll_ms: FIRST_POLL_MS,
            jitter: settings.jitter | 1,
        }
    }

    /// What the caller wants from the key.
    pub(crate) fn mode(&self) -> Mode {
        self.mode
    }

    /// The token this machine's claims and placeholders carry.
    pub(crate) fn token(&self) -> u64 {
        self.token
    }

    /// Whether this caller has paused for another caller's load ([`Action::Sleep`]): what it
    /// is served came after that load, not at once.
    pub(crate) fn slept(&self) -> bool {
        self.slept
    }

    /// How many of this caller's claim or placeholder writes another caller's write beat.
    pub(crate) fn races_lost(&self) -> u32 {
        self.races
    }

    /// The key was read.
    pub(crate) fn on_read(&mut self, now: Now, item: Option<Item>) -> Action {
        match item {
            None => self.missing(now),
            Some(item) => self.judge(now, item),
        }
    }

    /// The write of [`Action::StoreThenRead`] answered `outcome`, and the key then held `after`.
    pub(crate) fn on_stored(
        &mut self,
        now: Now,
        outcome: StoreOutcome,
        after: Option<Item>,
    ) -> Action {
        let pending = std::mem::replace(&mut self.pending, Pending::None);
        // Only this caller writes its token: an item that carries it is this caller's write
        // (even when the write's own reply was lost or came late), and its CAS is the claim's.
        if let Some(item) = after.as_ref().filter(|i| self.carries_token(i)) {
            let h = self.header_of(item);
            return self.holding(now, pending, item.clone(), h);
        }
        if outcome == StoreOutcome::Stored && self.rereads < MAX_REREADS {
            // Stored, yet the read-back does not show it: a proxy with several connections to
            // the server (twemproxy's `server_connections`) may run the pipelined read first.
            // Read again, now that the write has answered.
            self.rereads += 1;
            self.pending = pending;
            return Action::Read;
        }
        // Someone else wrote first (or right after us): judge what is there now.
        self.last = None;
        self.races += 1;
        if self.races > MAX_RACES {
            return match self.mode {
                Mode::Lookup => Action::Done(Found::Miss { claimed: false }),
                Mode::Batch => Action::Done(Found::Busy),
                Mode::Load => self.wait(now),
            };
        }
        self.on_read(now, after)
    }

    fn carries_token(&self, item: &Item) -> bool {
        matches!(envelope::decode(item.flags, &item.value),
                 Ok(Parsed::Item(h, _)) if h.token == self.token)
    }

    fn header_of(&self, item: &Item) -> Header {
        match envelope::decode(item.flags, &item.value) {
            Ok(Parsed::Item(h, _)) => h,
            _ => Header::placeholder(0, 0, 0),
        }
    }

    /// A pause ended.
    pub(crate) fn on_wake(&mut self, now: Now) -> Action {
        if self.waited_out(now) {
            return Action::Done(Found::TimedOut);
        }
        Action::Read
    }

    /// The backend failed during the last action. Serves the last item read if it may be served,
    /// else reports the backend unavailable.
    pub(crate) fn on_failed(&mut self, now: Now) -> Action {
        if self.pending != Pending::None && self.rereads < MAX_REREADS {
            // The write may have landed: read again, and hold the key if it carries our token.
            self.rereads += 1;
            return Action::Read;
        }
        self.pending = Pending::None;
        if self.saw_holder && self.mode == Mode::Load {
            // Someone is loading it: a failed poll is no reason to load too. Keep waiting.
            return self.wait(now);
        }
        if let Some(item) = self.last.take() {
            if let Ok(Parsed::Item(h, payload)) = envelope::decode(item.flags, &item.value) {
                let v = herd::judge(&h, now.wall_ms, None);
                if herd::servable(v) {
                    let offset = item.value.len() - payload.len();
                    let stale = matches!(v, Verdict::Stale | Verdict::Recomputing);
                    let held = Servable {
                        item,
                        offset,
                        header: h,
                        early: false,
                        expired: false,
                    };
                    return Action::Done(Found::Value { held, stale });
                }
            }
        }
        Action::Done(Found::Unavailable)
    }

    /// The backend refused the pending write before sending anything, for `why`. A claim
    /// re-stores the value with a longer header: an item written at the size limit (by another
    /// build, or a process with a larger item size) has no room for it, and a server without
    /// CAS cannot take a `cas` at all.
    ///
    /// - A fresh value XFetch wanted to refresh early is served as it is, unrefreshed.
    /// - `Lookup` (`get`) serves the stale value unclaimed while it may be served (a `get`
    ///   never takes a value away from other readers to recompute it): only a loader refreshes
    ///   it.
    /// - `Load` and `Batch`, too large: the key is taken over with a placeholder by `cas` against
    ///   the value read, lasting what the claim would have (still one holder). The holder keeps
    ///   the displaced value (its followers and its `serve_stale_on_error` are served it), and a
    ///   failed load puts it back (`Claim::release`); other processes wait meanwhile, as for a
    ///   missing key.
    /// - `Load` and `Batch`, a value over this cache's own limit ([`Settings::max_value`]): no
    ///   placeholder, since the value could not be put back. The caller loads without a claim
    ///   (its followers are served the value meanwhile) and completes with `cas` against the
    ///   value read ([`Claim::is_claim`]): a result that fits replaces it; one too large leaves
    ///   a stale value in place (past its bound, a "not storable" marker replaces it, as for
    ///   any load too large to store).
    /// - `Load` and `Batch`, no CAS: nothing can be fenced; the backend is unavailable for this
    ///   key (a batch loads it without storing; the single-key loader fails first).
    pub(crate) fn on_refused(&mut self, now: Now, why: Refusal) -> Action {
        let pending = std::mem::replace(&mut self.pending, Pending::None);
        let Some(item) = self.last.take() else {
            return Action::Done(Found::Unavailable);
        };
        let Pending::Claim {
            early,
            expired,
            until_ms,
        } = pending
        else {
            // A placeholder is a bare header: only a backend whose limit is below it, or one
            // without CAS (over a dead claim), refuses it.
            return Action::Done(Found::Unavailable);
        };
        let served = |item: Item, stale: bool| match envelope::decode(item.flags, &item.value) {
            Ok(Parsed::Item(header, payload)) => {
                let offset = item.value.len() - payload.len();
                let held = Servable {
                    item,
                    offset,
                    header,
                    early: false,
                    expired: false,
                };
                Action::Done(Found::Value { held, stale })
            }
            _ => Action::Done(Found::Unavailable),
        };
        match (self.mode, why) {
            _ if early => served(item, false),
            (Mode::Lookup, _) if expired => Action::Done(Found::Miss { claimed: false }),
            (Mode::Lookup, _) => served(item, true),
            (_, Refusal::NoCas) => Action::Done(Found::Unavailable),
            (_, Refusal::TooLarge) if item.value.len() > self.s.max_value => {
                self.unclaimed(now, item, expired)
            }
            (_, Refusal::TooLarge) => {
                let mode = StoreMode::Cas(item.cas);
                self.displaced = Some((item, expired));
                self.placeholder_until(now, mode, until_ms)
            }
        }
    }

    /// A claimed without a claim over `item`, a value this cache could not give back: the load
    /// runs, and its result is stored only by `cas` against `item` (nothing if another wrote
    /// the key meanwhile); nothing is renewed or given back.
    fn unclaimed(&mut self, now: Now, item: Item, expired: bool) -> Action {
        let Ok(Parsed::Item(header, payload)) = envelope::decode(item.flags, &item.value) else {
            return Action::Done(Found::Unavailable);
        };
        if item.cas == 0 {
            // Nothing could fence the store (memcached `-C`).
            return Action::Done(Found::Unavailable);
        }
        let lease = Claim {
            token: self.token,
            cas: item.cas,
            bytes: item.value.clone(),
            header,
            lease_ms: self.s.lease_ms,
            renew_until_ms: now.mono_ms,
            restore: None,
            claimed: false,
        };
        let held = Servable {
            offset: item.value.len() - payload.len(),
            item,
            header,
            early: false,
            expired,
        };
        Action::Load(Box::new(Claimed {
            claim: lease,
            value: Some(held),
        }))
    }

    /// The read was refused as too large: the key holds a value over this cache's limit that
    /// the backend discarded unread (memcached sends a value whole, whatever the reader's
    /// limit). A loader loads without a claim (one could not be given back) and stores
    /// nothing (no CAS to fence a store on). `None` in `Lookup` mode: a `get` reports the
    /// error.
    pub(crate) fn on_read_too_large(&mut self) -> Option<Action> {
        self.pending = Pending::None;
        match self.mode {
            Mode::Lookup => None,
            Mode::Load | Mode::Batch => Some(Action::Done(Found::Unavailable)),
        }
    }

    /// The front end could not use the value it was given (its payload does not decode as the
    /// requested type, or the bytes are foreign) and its policy is to overwrite it: take the key
    /// over with a placeholder, as for a dead claim. In `Lookup` mode: a miss.
    pub(crate) fn take_over(&mut self, now: Now) -> Action {
        match (self.mode, self.last.take()) {
            (Mode::Lookup, _) => Action::Done(Found::Miss { claimed: false }),
            (_, None) => self.missing(now),
            (_, Some(item)) => self.placeholder(now, StoreMode::Cas(item.cas)),
        }
    }

    fn missing(&mut self, now: Now) -> Action {
        match self.mode {
            Mode::Lookup => Action::Done(Found::Miss { claimed: false }),
            Mode::Load | Mode::Batch => self.placeholder(now, StoreMode::Add),
        }
    }

    fn judge(&mut self, now: Now, item: Item) -> Action {
        if self.pending != Pending::None && self.carries_token(&item) {
            let pending = std::mem::replace(&mut self.pending, Pending::None);
            let h = self.header_of(&item);
            return self.holding(now, pending, item, h);
        }
        self.pending = Pending::None;
        let (h, offset) = match envelope::decode(item.flags, &item.value) {
            Ok(Parsed::Item(h, payload)) => (h, item.value.len() - payload.len()),
            // A newer build's item: a counted miss in every mode. A load runs unclaimed and stores
            // nothing, so that two builds in a rolling deploy do not overwrite each other.
            Ok(Parsed::Newer(_)) => return Action::Done(Found::Newer),
            Err(e) => {
                self.last = Some(item);
                return Action::Done(Found::Foreign(e));
            }
        };
        let xfetch = match self.mode {
            Mode::Lookup => None,
            Mode::Load | Mode::Batch => self.s.xfetch,
        };
        let verdict = herd::judge(&h, now.wall_ms, xfetch);
        let held = |early, expired| Servable {
            item,
            offset,
            header: h,
            early,
            expired,
        };
        match verdict {
            Verdict::Fresh => Action::Done(Found::Value {
                held: held(false, false),
                stale: false,
            }),
            Verdict::Recomputing => Action::Done(Found::Value {
                held: held(false, false),
                stale: true,
            }),
            Verdict::Stale | Verdict::EarlyRefresh => {
                let early = verdict == Verdict::EarlyRefresh;
                self.claim(now, held(early, false))
            }
            Verdict::NotStorable => match self.mode {
                Mode::Lookup => Action::Done(Found::Miss { claimed: false }),
                Mode::Load | Mode::Batch => Action::Done(Found::NotStorable),
            },
            Verdict::Loading => match self.mode {
                Mode::Lookup | Mode::Batch => Action::Done(Found::Busy),
                Mode::Load => {
                    self.saw_holder = true;
                    self.wait(now)
                }
            },
            Verdict::Expired => match (self.mode, h.kind) {
                (Mode::Lookup, _) => Action::Done(Found::Miss { claimed: false }),
                // An over-age value is claimed with its bytes kept, for the holder's
                // serve-stale-on-error; nobody else is served it.
                (_, Kind::Value) => self.claim(now, held(false, true)),
                _ => {
                    self.last = Some(held(false, false).item);
                    self.take_over(now)
                }
            },
        }
    }

    /// Claims a value: the same bytes, with this caller's token and deadline.
    fn claim(&mut self, now: Now, held: Servable) -> Action {
        let until = match self.mode {
            // A `get` claimant is not renewed: its claim lasts the herd timeout, as in
            // django-newcache, but never past the value's staleness bound, after which it would
            // protect nothing servable and only hold up loaders.
            Mode::Lookup => {
                let h = &held.header;
                let bound = h.soft_expiry_ms.saturating_add(u64::from(h.herd_ms));
                now.wall_ms.saturating_add(self.s.herd_ms).min(bound)
            }
            Mode::Load | Mode::Batch => now.wall_ms.saturating_add(self.s.lease_ms),
        };
        self.pending = Pending::Claim {
            early: held.early,
            expired: held.expired,
            until_ms: until,
        };
        if held.item.value.len() > self.s.max_value {
            // Its size is known before the claim: a claim this cache's backend would refuse.
            self.last = Some(held.item);
            return self.on_refused(now, Refusal::TooLarge);
        }
        let Some(value) = envelope::restamp(&held.item.value, until, self.token) else {
            self.pending = Pending::None;
            self.last = Some(held.item);
            return self.take_over(now);
        };
        let exptime = hold_exptime(&held.header, until, now.wall_ms);
        let mode = StoreMode::Cas(held.item.cas);
        self.last = Some(held.item);
        Action::StoreThenRead {
            mode,
            value,
            exptime,
        }
    }

    /// Writes a placeholder with `mode` (`Add` on a missing key, `Cas` over a dead one).
    fn placeholder(&mut self, now: Now, mode: StoreMode) -> Action {
        self.placeholder_until(now, mode, now.wall_ms.saturating_add(self.s.lease_ms))
    }

    fn placeholder_until(&mut self, now: Now, mode: StoreMode, until: u64) -> Action {
        let header = Header::placeholder(now.wall_ms, until, self.token);
        self.pending = Pending::Placeholder;
        Action::StoreThenRead {
            mode,
            exptime: hold_exptime(&header, until, now.wall_ms),
            value: header.to_bytes(),
        }
    }

    /// This caller's write stuck: it holds the key.
    fn holding(&mut self, now: Now, pending: Pending, item: Item, h: Header) -> Action {
        let offset = envelope::decode(item.flags, &item.value)
            .ok()
            .and_then(|p| match p {
                Parsed::Item(_, payload) => Some(item.value.len() - payload.len()),
                Parsed::Newer(_) => None,
            })
            .unwrap_or(item.value.len());
        if self.mode == Mode::Lookup {
            return Action::Done(Found::Miss { claimed: true });
        }
        let displaced = self.displaced.take();
        let lease = Claim {
            token: self.token,
            cas: item.cas,
            bytes: item.value.clone(),
            header: h,
            lease_ms: self.s.lease_ms,
            renew_until_ms: now.mono_ms.saturating_add(self.s.max_load_ms),
            restore: displaced.as_ref().map(|(i, _)| i.clone()),
            claimed: true,
        };
        if let Some((item, expired)) = displaced {
            if let Ok(Parsed::Item(header, payload)) = envelope::decode(item.flags, &item.value) {
                let offset = item.value.len() - payload.len();
                let held = Servable {
                    item,
                    offset,
                    header,
                    early: false,
                    expired,
                };
                return Action::Load(Box::new(Claimed {
                    claim: lease,
                    value: Some(held),
                }));
            }
        }
        let held = match pending {
            Pending::Claim { early, expired, .. } => Some(Servable {
                item,
                offset,
                header: h,
                early,
                expired,
            }),
            Pending::Placeholder | Pending::None => None,
        };
        Action::Load(Box::new(Claimed {
            claim: lease,
            value: held,
        }))
    }

    fn waited_out(&self, now: Now) -> bool {
        now.mono_ms.saturating_sub(self.start_mono_ms) >= self.s.max_wait_ms
    }

    /// Waits for someone else's load: a jittered pause, bounded by what is left of `max_wait`.
    fn wait(&mut self, now: Now) -> Action {
        if self.waited_out(now) {
            return Action::Done(Found::TimedOut);
        }
        // xorshift: 50-100 % of the current step, steps 2 ms -> 10 ms.
        self.jitter = crate::rng::xorshift(self.jitter);
        let frac = 0.5 + (self.jitter >> 11) as f64 / (1u64 << 54) as f64;
        let left = self.s.max_wait_ms - now.mono_ms.saturating_sub(self.start_mono_ms);
        let pause = ((self.poll_ms as f64 * frac) as u64).clamp(1, left.max(1));
        self.poll_ms = (self.poll_ms * 3 / 2).min(MAX_POLL_MS);
        self.slept = true;
        Action::Sleep(Duration::from_millis(pause))
    }
}

/// The longest a "not storable" marker lives. A value too large to store is most likely as
/// large on its next load, so for this long every caller loads it at once, unclaimed (no herd
/// protection: the value cannot be shared through the backend anyway, and callers of one
/// process still share one load); after it, one caller claims the key and tries to store
/// again, so a value that shrank is cached within a minute, and waiters sit behind at most one
/// load per minute and key. Shorter if the value's own ttl is: it would have expired by then.
pub(crate) const NOT_STORABLE_FOR: Duration = Duration::from_secs(60);

/// The marker a holder stores (by `cas` against its claim, as it would its value) when the
/// loaded value is too large: its bytes and memcached `exptime`, for a value meant to live
/// `life`.
pub(crate) fn not_storable(now_ms: u64, life: Lifetime) -> (Vec<u8>, u32) {
    let lasts = match life {
        Lifetime::For(d) => d.min(NOT_STORABLE_FOR),
        Lifetime::Forever | Lifetime::Expired => NOT_STORABLE_FOR,
    };
    let until = now_ms.saturating_add(lasts.as_millis() as u64);
    let header = Header::not_storable(now_ms, until);
    // One second of slack over memcached's one-second clock: readers go by `until`.
    let exptime = ttl::exptime(Lifetime::For(lasts), Duration::from_secs(1), now_ms / 1000);
    (header.to_bytes(), exptime)
}

/// memcached's `exptime` for an item re-stored by a claim: it must stay until `until_ms` (the
/// claim's deadline: a claim must not vanish mid-load, or a second caller would load at once),
/// and a value at least as long as its writer meant it to (a claim never shortens an item's life:
/// readers may still serve it, or a holder's serve-stale-on-error may need it). One second of
/// slack covers memcached's one-second clock.
fn hold_exptime(h: &Header, until_ms: u64, now_ms: u64) -> u32 {
    let keep = match h.kind {
        Kind::Value | Kind::Plain if h.expires_ms == 0 => return 0,
        Kind::Value | Kind::Plain => until_ms.max(h.expires_ms),
        Kind::Placeholder => until_ms,
    };
    ttl::exptime(
        Lifetime::For(Duration::from_millis(keep.saturating_sub(now_ms).max(1))),
        Duration::from_secs(1),
        now_ms / 1000,
    )
}

/// What a renewal's read-back says about the claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Renewal {
    /// Still this holder's, with the CAS token read back.
    Kept,
    /// Written, deleted or taken over by someone else.
    Lost,
    /// This holder's, but read before the renewal's write ran: read again.
    Unsure,
}

/// The write that gives back a claim (or placeholder) whose writer went away before it learned
/// whether the write landed (an async caller dropped mid-claim, or a failed load): `Some` only
/// if `item` still carries `token`'s claim, and then it is released exactly as a failed load
/// releases it (a placeholder removed, or the value it displaced, `restore`, put back; a value
/// unclaimed), by `cas` against what was read.
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) fn release_abandoned(
    item: &Item,
    token: u64,
    restore: Option<Item>,
    now: Now,
) -> Option<Action> {
    let Ok(Parsed::Item(header, _)) = envelope::decode(item.flags, &item.value) else {
        return None;
    };
    if token == 0 || header.token != token {
        return None;
    }
    let lease = Claim {
        token,
        cas: item.cas,
        bytes: item.value.clone(),
        header,
        lease_ms: 0,
        renew_until_ms: 0,
        restore,
        claimed: true,
    };
    lease.release(now)
}

/// A claim this caller holds under a key (its token written there, or a load fenced on the value
/// read): what its renewal, its completion with `cas` and its give-back write. One name across
/// the crate: a *claim* is this; a *lease* is a claim kept while a loader runs
/// (`loader::driver::LeaseHandle`, with a sync and an async flavour).
#[derive(Debug, Clone)]
pub(crate) struct Claim {
    token: u64,
    /// The CAS token of the claimed item as this caller last wrote it.
    cas: u64,
    /// The claimed item's bytes as this caller last wrote them.
    bytes: bytes::Bytes,
    header: Header,
    lease_ms: u64,
    /// Monotonic ms after which the claim is no longer renewed.
    renew_until_ms: u64,
    /// The value this placeholder displaced (a claim that had no room for its header): put
    /// back, unclaimed, if the load fails.
    restore: Option<Item>,
    /// This caller's token is under the key. `false`: a load over a value this cache could not
    /// claim, fenced on the value read; nothing to renew or give back.
    claimed: bool,
}

impl Claim {
    /// Whether this caller holds a claim under the key (else the load is only fenced on the
    /// value it read: see [`Machine::on_refused`]).
    pub(crate) fn is_claim(&self) -> bool {
        self.claimed
    }

    /// Whether this claim holds a value other readers are served meanwhile (a stale value
    /// within its bound, claimed or displaced by a placeholder), or one kept for
    /// `serve_stale_on_error` (computed at most `kept_ms` ago; 0: none is kept): a load whose
    /// result cannot be stored then gives it back (`release`) rather than replacing it with a
    /// "not storable" marker, so that readers keep being served it (or a failed refresh falls
    /// back to it) and one caller refreshes it at a time.
    pub(crate) fn serves_others(&self, now_ms: u64, kept_ms: u64) -> bool {
        let header = match &self.restore {
            Some(item) => match envelope::decode(item.flags, &item.value) {
                Ok(Parsed::Item(h, _)) => h,
                _ => return false,
            },
            None => self.header,
        };
        let unclaimed = Header {
            claim_until_ms: 0,
            ..header
        };
        let kept = kept_ms > 0 && now_ms.saturating_sub(header.written_ms) <= kept_ms;
        header.kind != Kind::Placeholder
            && (kept || herd::servable(herd::judge(&unclaimed, now_ms, None)))
    }

    /// How often a running load renews its claim: a third of the lease, so that two renewals
    /// can fail before it lapses.
    pub(crate) fn renew_every(&self) -> Duration {
        Duration::from_millis((self.lease_ms / 3).max(1))
    }

    /// The write that renews the claim now (`cas` with a later deadline, then read back), or
    /// `None` once the load has run `max_load_time`: the claim then lapses and one waiter takes
    /// over.
    pub(crate) fn renewal(&self, now: Now) -> Option<Action> {
        if !self.claimed || now.mono_ms >= self.renew_until_ms {
            return None;
        }
        let until = now.wall_ms.saturating_add(self.lease_ms);
        let value = envelope::restamp(&self.bytes, until, self.token)?;
        Some(Action::StoreThenRead {
            mode: StoreMode::Cas(self.cas),
            exptime: hold_exptime(&self.header, until, now.wall_ms),
            value,
        })
    }

    /// The renewal's read-back (or, after [`Renewal::Unsure`], a second read with `last` set)
    /// found `after`. Lost if the key no longer carries this holder's token (it was written or
    /// deleted, or taken over): the load's result will then not be stored, and renewing stops.
    pub(crate) fn on_renewed(&mut self, after: Option<Item>, last: bool) -> Renewal {
        let Some(item) = after else {
            return Renewal::Lost;
        };
        // Only this holder writes its token: an item carrying it is this holder's (a renewal
        // whose reply was lost included), and its CAS is the claim's.
        if !matches!(envelope::decode(item.flags, &item.value),
                     Ok(Parsed::Item(h, _)) if h.token == self.token)
        {
            return Renewal::Lost;
        }
        // Ours, but the version the renewal's `cas` replaces (memcached gives every store a new
        // CAS): a proxy with several connections per server may run the pipelined read before
        // the `cas`. Adopting it would lose the claim at the next `cas`; read again. Decided by
        // CAS, not by claim deadlines, so a clock that stands still or steps back cannot fool it.
        if item.cas == self.cas && !last {
            return Renewal::Unsure;
        }
        self.cas = item.cas;
        self.bytes = item.value;
        Renewal::Kept
    }

    /// How to store the loaded value: `cas` against the claim.
    pub(crate) fn store_mode(&self) -> StoreMode {
        StoreMode::Cas(self.cas)
    }

    /// The write that gives the key back after a failed load: a placeholder is removed (a
    /// `cas` with an exptime in the past), a value is unclaimed (its bytes kept). Waiters need not
    /// sit out the deadline: the next caller retries the load at once, one at a time. `None`
    /// without a claim: the key holds nothing of this caller's.
    ///
    /// A give-back the backend fails to write is followed by [`removal`].
    pub(crate) fn release(&self, now: Now) -> Option<Action> {
        if !self.claimed {
            return None;
        }
        let mode = StoreMode::Cas(self.cas);
        if let Some(item) = &self.restore {
            // The displaced value goes back as it was (it fit before), unclaimed.
            if let Ok(Parsed::Item(h, _)) = envelope::decode(item.flags, &item.value) {
                return Some(Action::StoreThenRead {
                    mode,
                    exptime: hold_exptime(&h, now.wall_ms, now.wall_ms),
                    value: envelope::restamp(&item.value, 0, 0)
                        .unwrap_or_else(|| item.value.to_vec()),
                });
            }
        }
        Some(match self.header.kind {
            Kind::Placeholder => removal(mode),
            Kind::Value | Kind::Plain => Action::StoreThenRead {
                mode,
                exptime: hold_exptime(&self.header, now.wall_ms, now.wall_ms),
                value: envelope::restamp(&self.bytes, 0, 0).unwrap_or_default(),
            },
        })
    }
}

/// A [`Claim`] kept while its loader runs, as both front ends keep it (the sync renewal
/// thread, an async caller's future): when its next renewal is due, whether it was lost, and
/// whether it is finished. The front end runs the writes (`loader::lease`); what they are and
/// what their outcomes mean is decided here. Times are the front end's `Instant`s, read by it.
#[derive(Debug)]
pub(crate) struct Lease {
    pub(crate) claim: Claim,
    /// When the next renewal is due.
    next: Instant,
    /// No more renewals: finished, lost, or past `max_load_time`.
    idle: bool,
    /// The claim was lost: the key was written, deleted or taken over meanwhile.
    lost: bool,
    /// Completed, or given back.
    done: bool,
}

impl Lease {
    /// Keeps `claim` from `now`: its first renewal is due a third of the lease later.
    pub(crate) fn new(claim: Claim, now: Instant) -> Lease {
        Lease {
            next: now + claim.renew_every(),
            claim,
            idle: false,
            lost: false,
            done: false,
        }
    }

    /// When the next renewal is due; `None` once renewals have stopped.
    pub(crate) fn due_at(&self) -> Option<Instant> {
        (!self.idle && !self.done).then_some(self.next)
    }

    /// Completed or given back.
    pub(crate) fn is_done(&self) -> bool {
        self.done
    }

    /// The write that renews the claim now ([`Claim::renewal`]); `None` once renewals have
    /// stopped (past `max_load_time` the claim lapses, and one waiter takes over).
    pub(crate) fn renewal(&mut self, now: Now) -> Option<Action> {
        if self.idle || self.done {
            return None;
        }
        let renewal = self.claim.renewal(now);
        self.idle = renewal.is_none();
        renewal
    }

    /// The renewal's read-back found `after` ([`Claim::on_renewed`]); a lost claim stops
    /// renewing, and its load's result is not stored.
    pub(crate) fn on_renewed(&mut self, after: Option<Item>, last: bool) -> Renewal {
        let r = self.claim.on_renewed(after, last);
        if r == Renewal::Lost {
            self.lost = true;
            self.idle = true;
        }
        r
    }

    /// A renewal was tried at `at` (whatever came of it: a failed one is tried again next
    /// time; two failures in a row still leave a third of the lease).
    pub(crate) fn renewed(&mut self, at: Instant) {
        self.next = at + self.claim.renew_every();
    }

    /// Stops renewing to store the loaded value: how to write it (`cas` against the claim),
    /// or `None` if the claim was lost (the lease is then finished: superseded).
    pub(crate) fn completing(&mut self) -> Option<StoreMode> {
        self.idle = true;
        if self.lost {
            self.done = true;
            return None;
        }
        Some(self.claim.store_mode())
    }

    /// The value is stored, or its claim removed: nothing left to give back.
    pub(crate) fn finish(&mut self) {
        self.done = true;
    }

    /// The write that gives back an unfinished lease's claim by its holder ([`Claim::release`]),
    /// once: `None` if it is finished, lost, or not a claim.
    pub(crate) fn release(&mut self, now: Now) -> Option<Action> {
        if std::mem::replace(&mut self.done, true) {
            return None;
        }
        self.idle = true;
        if self.lost {
            return None;
        }
        self.claim.release(now)
    }

    /// What an unfinished lease whose holder went away leaves to give back by token (its
    /// token, and the value its placeholder displaced: see [`release_abandoned`]); `None` if it
    /// is finished, lost, or not a claim.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn abandoned(&self) -> Option<(u64, Option<Item>)> {
        (!self.done && !self.lost && self.claim.is_claim())
            .then(|| (self.claim.token, self.claim.restore.clone()))
    }
}

/// The write that removes a claim outright, fenced as the give-back `mode` was: a `cas` with an
/// exptime in the past. What a placeholder's give-back is, and what follows a give-back of a
/// value that failed to write (refused by the server, `OOM`, a broken connection), so that
/// nobody sits out the claim's deadline: the value goes, and the next caller loads.
pub(crate) fn removal(mode: StoreMode) -> Action {
    Action::StoreThenRead {
        mode,
        value: Vec::new(),
        exptime: ttl::EXPIRED,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: u64 = 0xAB;
    const SETTINGS: Settings = Settings {
        herd_ms: 60_000,
        lease_ms: 5_000,
        max_wait_ms: 1_000,
        max_load_ms: 60_000,
        xfetch: None,
        jitter: 0x5EED,
        max_value: 1 << 20,
    };

    fn at(ms: u64) -> Now {
        Now {
            wall_ms: 1_000_000 + ms,
            mono_ms: ms,
        }
    }

    fn value(soft_in_ms: u64, cas: u64) -> Item {
        let mut b = Vec::new();
        Header {
            expires_ms: 1_000_000 + soft_in_ms + 60_000,
            ..Header::value(1_000_000 + soft_in_ms, 1_000_000, 10, 60_000)
        }
        .write(&mut b);
        b.extend_from_slice(b"v");
        Item {
            value: b.into(),
            flags: envelope::FLAGS,
            cas,
        }
    }

    /// What the server holds after `action` succeeds with this CAS.
    fn stored(action: &Action, cas: u64) -> Item {
        let Action::StoreThenRead { value, .. } = action else {
            panic!("expected a write, got {action:?}")
        };
        Item {
            value: value.clone().into(),
            flags: envelope::FLAGS,
            cas,
        }
    }

    /// The header and payload `a` writes, by `cas` against `cas`.
    #[track_caller]
    fn written_by_cas(a: &Action, cas: u64) -> (Header, &[u8]) {
        let Action::StoreThenRead { mode, value, .. } = a else {
            panic!("{a:?}")
        };
        assert_eq!(*mode, StoreMode::Cas(cas), "{a:?}");
        let Ok(Parsed::Item(h, payload)) = envelope::decode(envelope::FLAGS, value) else {
            panic!()
        };
        (h, payload)
    }

    #[test]
    fn fresh_is_served_without_a_write() {
        let mut m = Machine::new(Mode::Load, SETTINGS, TOKEN, at(0));
        let a = m.on_read(at(0), Some(value(10, 1)));
        assert!(
            matches!(a, Action::Done(Found::Value { stale: false, .. })),
            "{a:?}"
        );
    }

    #[test]
    fn cold_load_adds_a_placeholder_and_holds_it() {
        let mut m = Machine::new(Mode::Load, SETTINGS, TOKEN, at(0));
        let a = m.on_read(at(0), None);
        assert!(matches!(
            a,
            Action::StoreThenRead {
                mode: StoreMode::Add,
                ..
            }
        ));
        let back = stored(&a, 7);
        let Action::Load(g) = m.on_stored(at(0), StoreOutcome::Stored, Some(back)) else {
            panic!()
        };
        assert!(g.value.is_none());
        assert!(
            !g.claim.serves_others(1_000_000, 0),
            "a placeholder serves nobody"
        );
        assert_eq!(g.claim.store_mode(), StoreMode::Cas(7));
        // a failed load removes the placeholder at once
        assert!(matches!(
            g.claim.release(at(1)),
            Some(Action::StoreThenRead {
                mode: StoreMode::Cas(7),
                exptime: ttl::EXPIRED,
                ..
            })
        ));
    }

    #[test]
    fn a_lost_add_waits_for_the_holder_then_times_out() {
        let mut m = Machine::new(Mode::Load, SETTINGS, TOKEN, at(0));
        let _ = m.on_read(at(0), None);
        let theirs = Item {
            value: Header::placeholder(1_000_000, 1_005_000, 99)
                .to_bytes()
                .into(),
            flags: envelope::FLAGS,
            cas: 3,
        };
        let a = m.on_stored(at(0), StoreOutcome::NotStored, Some(theirs.clone()));
        assert!(matches!(a, Action::Sleep(_)), "{a:?}");
        assert!(matches!(m.on_wake(at(500)), Action::Read));
        assert!(matches!(m.on_read(at(500), Some(theirs)), Action::Sleep(_)));
        assert!(matches!(
            m.on_wake(at(1_000)),
            Action::Done(Found::TimedOut)
        ));
    }

    #[test]
    fn a_dead_placeholder_is_taken_over_with_cas() {
        let mut m = Machine::new(Mode::Load, SETTINGS, TOKEN, at(0));
        let dead = Item {
            value: Header::placeholder(999_000, 999_500, 99).to_bytes().into(),
            flags: envelope::FLAGS,
            cas: 3,
        };
        let a = m.on_read(at(0), Some(dead));
        assert!(matches!(
            a,
            Action::StoreThenRead {
                mode: StoreMode::Cas(3),
                ..
            }
        ));
    }

    #[test]
    fn stale_claim_keeps_the_value_and_renews() {
        let mut m = Machine::new(Mode::Load, SETTINGS, TOKEN, at(0));
        let a = m.on_read(at(20), Some(value(10, 1)));
        assert!(matches!(
            a,
            Action::StoreThenRead {
                mode: StoreMode::Cas(1),
                ..
            }
        ));
        let back = stored(&a, 2);
        let Action::Load(mut g) = m.on_stored(at(20), StoreOutcome::Stored, Some(back)) else {
            panic!()
        };
        let held = g.value.as_ref().expect("the stale value");
        assert_eq!(&held.item.value[held.offset..], b"v");
        assert!(
            g.claim.serves_others(1_000_020, 0),
            "a stale value others are served"
        );
        assert!(
            !g.claim.serves_others(1_060_010, 0),
            "past its bound it serves nobody"
        );
        // a failed load unclaims the stale value, keeping it
        let r = g.claim.release(at(21)).expect("a give-back");
        let back = stored(&r, 3);
        let Ok(Parsed::Item(h, payload)) = envelope::decode(back.flags, &back.value) else {
            panic!()
        };
        assert_eq!((h.claim_until_ms, h.token, payload), (0, 0, &b"v"[..]));
        let before = stored(&g.claim.renewal(at(1_000)).unwrap(), 4);
        assert_eq!(
            g.claim.on_renewed(Some(before.clone()), false),
            Renewal::Kept
        );
        let r = g.claim.renewal(at(2_000)).expect("renews within max_load");
        // a proxy ran the read-back before the cas: the older version is not adopted
        assert_eq!(g.claim.on_renewed(Some(before), false), Renewal::Unsure);
        assert_eq!(g.claim.store_mode(), StoreMode::Cas(4));
        let back = stored(&r, 5);
        assert_eq!(g.claim.on_renewed(Some(back), true), Renewal::Kept);
        assert_eq!(g.claim.store_mode(), StoreMode::Cas(5));
        // someone deleted the key: the claim is lost
        assert_eq!(g.claim.on_renewed(None, false), Renewal::Lost);
        assert!(g.claim.renewal(at(60_020)).is_none(), "not past max_load");
    }

    #[test]
    fn a_claim_with_no_room_takes_the_key_over_with_a_placeholder() {
        for mode in [Mode::Load, Mode::Batch] {
            let mut m = Machine::new(mode, SETTINGS, TOKEN, at(0));
            let claim = m.on_read(at(20), Some(value(10, 1)));
            assert!(matches!(claim, Action::StoreThenRead { .. }), "{claim:?}");
            // refused as too large: a placeholder over the value read, by cas
            let a = m.on_refused(at(20), Refusal::TooLarge);
            let (h, _) = written_by_cas(&a, 1);
            assert_eq!((h.kind, h.token), (Kind::Placeholder, TOKEN));
            let back = stored(&a, 2);
            let Action::Load(g) = m.on_stored(at(20), StoreOutcome::Stored, Some(back)) else {
                panic!("{mode:?}")
            };
            // the holder keeps the displaced value, and a failed load puts it back unclaimed
            let held = g.value.as_ref().expect("the displaced value");
            assert_eq!(&held.item.value[held.offset..], b"v");
            assert_eq!(g.claim.store_mode(), StoreMode::Cas(2));
            let r = g.claim.release(at(21)).expect("a give-back");
            let (h, payload) = written_by_cas(&r, 2);
            assert_eq!((h.kind, h.token, payload), (Kind::Value, 0, &b"v"[..]));
        }
        // a `get` serves it stale, unclaimed, in either case; a loader without CAS is told
        for why in [Refusal::TooLarge, Refusal::NoCas] {
            let mut m = Machine::new(Mode::Lookup, SETTINGS, TOKEN, at(0));
            let _ = m.on_read(at(20), Some(value(10, 1)));
            assert!(matches!(
                m.on_refused(at(20), why),
                Action::Done(Found::Value { stale: true, .. })
            ));
        }
        let mut m = Machine::new(Mode::Batch, SETTINGS, TOKEN, at(0));
        let _ = m.on_read(at(20), Some(value(10, 1)));
        assert!(matches!(
            m.on_refused(at(20), Refusal::NoCas),
            Action::Done(Found::Unavailable)
        ));
        // a fresh value XFetch wanted to refresh early is served as it is
        let early = Settings {
            xfetch: Some(Xfetch {
                beta: 1e9,
                draw: 0.5,
            }),
            ..SETTINGS
        };
        let mut m = Machine::new(Mode::Load, early, TOKEN, at(0));
        let item = Item {
            value: {
                let mut b = Vec::new();
                Header::value(1_000_000 + 10_000, 1_000_000, 100, 60_000).write(&mut b);
                b.extend_from_slice(b"v");
                b.into()
            },
            flags: envelope::FLAGS,
            cas: 1,
        };
        assert!(matches!(
            m.on_read(at(0), Some(item)),
            Action::StoreThenRead { .. }
        ));
        assert!(matches!(
            m.on_refused(at(0), Refusal::TooLarge),
            Action::Done(Found::Value { stale: false, .. })
        ));
    }

    #[test]
    fn a_value_over_this_caches_limit_is_never_claimed() {
        let small = Settings {
            max_value: value(10, 1).value.len() - 1,
            ..SETTINGS
        };
        // a `get` serves it stale, writing nothing
        let mut m = Machine::new(Mode::Lookup, small, TOKEN, at(0));
        assert!(matches!(
            m.on_read(at(20), Some(value(10, 1))),
            Action::Done(Found::Value { stale: true, .. })
        ));
        for mode in [Mode::Load, Mode::Batch] {
            // a loader loads without a claim, its store fenced on the value read
            let mut m = Machine::new(mode, small, TOKEN, at(0));
            let Action::Load(g) = m.on_read(at(20), Some(value(10, 1))) else {
                panic!("{mode:?}")
            };
            assert!(!g.claim.is_claim());
            assert_eq!(g.claim.store_mode(), StoreMode::Cas(1));
            let held = g
                .value
                .as_ref()
                .expect("the stale value, for the followers");
            assert_eq!(&held.item.value[held.offset..], b"v");
            assert!(g.claim.serves_others(1_000_020, 0));
            // nothing to renew, nothing to give back: the value stays as it is
            assert!(g.claim.renewal(at(30)).is_none());
            assert!(g.claim.release(at(30)).is_none());
            // without CAS nothing could fence the store: loaded, not stored
            let mut m = Machine::new(mode, small, TOKEN, at(0));
            assert!(matches!(
                m.on_read(at(20), Some(value(10, 0))),
                Action::Done(Found::Unavailable)
            ));
            // one the backend discarded unread: loaded, not stored
            let mut m = Machine::new(mode, small, TOKEN, at(0));
            assert!(matches!(
                m.on_read_too_large(),
                Some(Action::Done(Found::Unavailable))
            ));
        }
        let mut m = Machine::new(Mode::Lookup, small, TOKEN, at(0));
        assert!(m.on_read_too_large().is_none(), "a `get` reports it");
    }

    #[test]
    fn a_lost_claim_serves_what_won() {
        let mut m = Machine::new(Mode::Load, SETTINGS, TOKEN, at(0));
        let _ = m.on_read(at(20), Some(value(10, 1)));
        let mut theirs = value(10, 2);
        theirs.value = envelope::restamp(&theirs.value, 1_005_000, 99)
            .unwrap()
            .into();
        let a = m.on_stored(at(20), StoreOutcome::Exists, Some(theirs));
        assert!(
            matches!(a, Action::Done(Found::Value { stale: true, .. })),
            "{a:?}"
        );
    }

    #[test]
    fn lookup_claims_report_a_miss_and_never_wait() {
        let mut m = Machine::new(Mode::Lookup, SETTINGS, TOKEN, at(0));
        let a = m.on_read(at(20), Some(value(10, 1)));
        let back = stored(&a, 2);
        assert!(matches!(
            m.on_stored(at(20), StoreOutcome::Stored, Some(back)),
            Action::Done(Found::Miss { claimed: true })
        ));
        let mut m = Machine::new(Mode::Lookup, SETTINGS, TOKEN, at(0));
        assert!(matches!(
            m.on_read(at(0), None),
            Action::Done(Found::Miss { claimed: false })
        ));
        let ph = Item {
            value: Header::placeholder(1_000_000, 1_005_000, 99)
                .to_bytes()
                .into(),
            flags: envelope::FLAGS,
            cas: 3,
        };
        assert!(matches!(
            m.on_read(at(0), Some(ph)),
            Action::Done(Found::Busy)
        ));
    }

    #[test]
    fn over_age_values_are_never_served() {
        // soft expiry at +10 ms, herd 60 s: at +60_010 it is past its bound
        let mut m = Machine::new(Mode::Lookup, SETTINGS, TOKEN, at(0));
        assert!(matches!(
            m.on_read(at(60_010), Some(value(10, 1))),
            Action::Done(Found::Miss { claimed: false })
        ));
        let mut m = Machine::new(Mode::Load, SETTINGS, TOKEN, at(0));
        let a = m.on_read(at(60_010), Some(value(10, 1)));
        let back = stored(&a, 2);
        let Action::Load(g) = m.on_stored(at(60_010), StoreOutcome::Stored, Some(back)) else {
            panic!()
        };
        assert!(
            g.value.unwrap().expired,
            "kept only for serve-stale-on-error"
        );
    }

    #[test]
    fn a_not_storable_marker_is_loaded_by_every_caller_at_once() {
        let (bytes, exptime) = not_storable(1_000_000, Lifetime::For(Duration::from_secs(600)));
        assert_eq!(
            exptime, 61,
            "capped at NOT_STORABLE_FOR, plus a second of slack"
        );
        let marker = Item {
            value: bytes.into(),
            flags: envelope::FLAGS,
            cas: 4,
        };
        let expect = |mode, now, want: &dyn Fn(&Action) -> bool| {
            let mut m = Machine::new(mode, SETTINGS, TOKEN, at(0));
            let a = m.on_read(at(now), Some(marker.clone()));
            assert!(want(&a), "{mode:?} at {now}: {a:?}");
        };
        expect(Mode::Lookup, 0, &|a| {
            matches!(a, Action::Done(Found::Miss { claimed: false }))
        });
        for mode in [Mode::Load, Mode::Batch] {
            // no wait, no claim: load it yourself
            expect(mode, 0, &|a| matches!(a, Action::Done(Found::NotStorable)));
            // past its deadline: taken over by cas, as a dead placeholder
            expect(mode, 60_000, &|a| {
                matches!(
                    a,
                    Action::StoreThenRead {
                        mode: StoreMode::Cas(4),
                        ..
                    }
                )
            });
        }
        // a short ttl makes a short marker
        let (_, exptime) = not_storable(1_000_000, Lifetime::For(Duration::from_secs(5)));
        assert_eq!(exptime, 6);
    }

    #[test]
    fn newer_formats_are_a_miss_in_every_mode() {
        let newer = Item {
            value: b"NC\x09future".to_vec().into(),
            flags: envelope::FLAGS,
            cas: 4,
        };
        for mode in [Mode::Lookup, Mode::Load, Mode::Batch] {
            let mut m = Machine::new(mode, SETTINGS, TOKEN, at(0));
            assert!(matches!(
                m.on_read(at(0), Some(newer.clone())),
                Action::Done(Found::Newer)
            ));
        }
    }

    #[test]
    fn a_stored_write_not_yet_visible_is_read_again_and_adopted() {
        // a proxy ran the pipelined read before the add: the read-back shows nothing
        let mut m = Machine::new(Mode::Load, SETTINGS, TOKEN, at(0));
        let add = m.on_read(at(0), None);
        let ours = stored(&add, 9);
        assert!(matches!(
            m.on_stored(at(0), StoreOutcome::Stored, None),
            Action::Read
        ));
        assert!(matches!(m.on_read(at(1), Some(ours)), Action::Load(_)));
    }

    #[test]
    fn claims_outlive_their_deadline_in_memcached() {
        // a placeholder of a 5 s lease lives 5 s + 1 s of slack
        let h = Header::placeholder(1_000_000, 1_005_000, 1);
        assert_eq!(hold_exptime(&h, 1_005_000, 1_000_000), 6);
        // a value stays as long as its writer meant, even when the claim is shorter
        let v = Header {
            expires_ms: 1_061_000,
            ..Header::value(1_000_010, 1_000_000, 0, 60_000)
        };
        assert_eq!(hold_exptime(&v, 1_005_000, 1_000_000), 62);
        // a claim that outlasts it keeps it for the claim
        assert_eq!(hold_exptime(&v, 1_100_000, 1_000_000), 101);
        // a value that never expires is never given an expiry by a claim
        let forever = Header::value(1_000_010, 1_000_000, 0, 60_000);
        assert_eq!(hold_exptime(&forever, 1_005_000, 1_000_000), 0);
    }
}
