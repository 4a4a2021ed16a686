//! The replay gate, one for every client of a server: before a caller sends anything to a
//! server whose record of missed invalidations holds keys (`outage.rs`), the keys are deleted
//! there (the replay), by this caller or, while another caller runs that replay, after waiting
//! for its end; then the caller goes on.
//!
//! The decision (nothing to replay, this caller's replay, another caller's) is the record's
//! ([`Missed::begin`]). What is each client's own is passed in: how a replay runs (`run`: on the
//! pool's connection, on the task of the engine's new connection, as a Redis request), and how
//! long a caller waits for another's ([`WaitBound`]: as long as a replay may take on that
//! client). The wait itself is written twice, as thin as it goes: a thread blocks
//! ([`enter`]), a task awaits ([`enter_async`]).

#[cfg(feature = "tokio")]
use std::future::Future;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use super::Options;
use super::health::Health;
use super::outage::{Begin, Missed, Replay};
use crate::error::{Error, Result};

/// A server's record of missed invalidations, held by a replay (which may outlive its caller: it
/// runs in a task, the engine's connection's or the Redis async view's replay).
pub(crate) struct MissedOf(pub(crate) Arc<Health>);

impl Deref for MissedOf {
    type Target = Missed;

    fn deref(&self) -> &Missed {
        &self.0.missed
    }
}

/// How long a caller waits for another caller's replay before it gives up: as long as that
/// replay may take on the client running it, in `connect_timeout`s and `io_timeout`s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WaitBound {
    pub(crate) connects: u32,
    pub(crate) ios: u32,
}

impl WaitBound {
    /// The bound with the timeouts of `options`.
    pub(crate) fn of(self, options: &Options) -> Duration {
        options
            .connect_timeout
            .saturating_mul(self.connects)
            .saturating_add(options.io_timeout.saturating_mul(self.ios))
    }
}

/// What the caller about to use `health`'s server does first: nothing (one load, no clone,
/// when the record is clear), its replay, or wait for another caller's.
fn begin(health: &Arc<Health>) -> Begin<MissedOf> {
    if !health.missed.pending() {
        return Begin::Clear;
    }
    Missed::begin(MissedOf(health.clone()))
}

/// The error of a caller that waited in vain for another caller's replay.
fn busy() -> Error {
    Error::backend("another caller's replay of the invalidations it missed is still running")
}

/// Passes the replay gate of `health`'s server, blocking: `Ok(None)` when there is nothing to
/// replay (or another caller's replay ended while this one waited), `Ok(Some(run(replay)))`
/// when this caller is to replay (`run` deletes the keys and settles the replay, or drops it
/// to give them back), and the error of a caller that waited `wait` for another's in vain
/// (naming no server: the caller's client does).
pub(crate) fn enter<R>(
    health: &Arc<Health>,
    wait: Duration,
    run: impl FnOnce(Replay<MissedOf>) -> R,
) -> Result<Option<R>> {
    loop {
        match begin(health) {
            Begin::Clear => return Ok(None),
            Begin::Mine(replay) => return Ok(Some(run(replay))),
            Begin::Busy => {
                if !health.missed.wait(wait) {
                    return Err(busy());
                }
            }
        }
    }
}

/// [`enter`], awaited: a task waits for another caller's replay without blocking its thread,
/// and awaits its own (`run`'s future).
#[cfg(feature = "tokio")]
pub(crate) async fn enter_async<R, F: Future<Output = R>>(
    health: &Arc<Health>,
    wait: Duration,
    run: impl FnOnce(Replay<MissedOf>) -> F,
) -> Result<Option<R>> {
    loop {
        match begin(health) {
            Begin::Clear => return Ok(None),
            Begin::Mine(replay) => return Ok(Some(run(replay).await)),
            Begin::Busy => {
                if !health.missed.wait_async(wait).await {
                    return Err(busy());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    fn health() -> Arc<Health> {
        Arc::new(Health::new("memcached", "a:1", &Options::default()))
    }

    /// A replay as a client runs one: its keys deleted, the replay settled.
    fn deleted(replay: Replay<MissedOf>) -> Vec<String> {
        let keys = replay.keys().map(str::to_owned).collect();
        replay.done("a:1", 0, |_| None, 10);
        keys
    }

    #[test]
    fn the_bound_is_counted_in_the_clients_timeouts() {
        let options = Options {
            connect_timeout: Duration::from_millis(100),
            io_timeout: Duration::from_millis(7),
            ..Options::default()
        };
        let bound = WaitBound {
            connects: 3,
            ios: 2,
        };
        assert_eq!(bound.of(&options), Duration::from_millis(314));
    }

    #[test]
    fn a_clear_record_runs_nothing_and_a_recorded_key_is_replayed_first() {
        let h = health();
        let none = enter::<()>(&h, Duration::ZERO, |_| panic!("nothing to replay")).unwrap();
        assert!(none.is_none());
        h.missed.note("k", None, 10);
        let keys = enter(&h, Duration::ZERO, deleted).unwrap();
        assert_eq!(keys, Some(vec!["k".to_owned()]));
        assert!(!h.missed.pending());
    }

    #[test]
    fn a_caller_waits_for_another_callers_replay_then_goes_on() {
        let h = health();
        h.missed.note("k", None, 10);
        let Begin::Mine(theirs) = begin(&h) else {
            panic!("the first caller replays")
        };
        let ends = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            deleted(theirs)
        });
        let t = Instant::now();
        let mine = enter::<()>(&h, Duration::from_secs(10), |_| panic!("theirs ran it")).unwrap();
        assert!(mine.is_none(), "nothing left to replay");
        assert!(
            t.elapsed() >= Duration::from_millis(40),
            "{:?}",
            t.elapsed()
        );
        assert_eq!(ends.join().unwrap(), ["k"]);
    }

    #[test]
    fn a_caller_that_waits_in_vain_gives_up_after_its_bound() {
        let h = health();
        h.missed.note("k", None, 10);
        let Begin::Mine(theirs) = begin(&h) else {
            panic!("the first caller replays")
        };
        let t = Instant::now();
        let e = enter(&h, Duration::from_millis(30), |_| ()).unwrap_err();
        assert!(
            t.elapsed() >= Duration::from_millis(30),
            "{:?}",
            t.elapsed()
        );
        assert!(e.to_string().contains("still running"), "{e}");
        drop(theirs);
        assert!(h.missed.pending(), "the dropped replay gave its key back");
    }

    #[cfg(feature = "tokio")]
    #[tokio::test]
    async fn a_task_waits_for_another_callers_replay_then_replays_what_was_recorded_meanwhile() {
        let h = health();
        h.missed.note("a", None, 10);
        let Begin::Mine(theirs) = begin(&h) else {
            panic!("the first caller replays")
        };
        let other = h.clone();
        let ends = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            other.missed.note("b", None, 10);
            deleted(theirs)
        });
        let mine = enter_async(&h, Duration::from_secs(10), |r| async move { deleted(r) })
            .await
            .unwrap();
        assert_eq!(
            mine,
            Some(vec!["b".to_owned()]),
            "b, recorded during theirs"
        );
        assert_eq!(ends.await.unwrap(), ["a"]);
        let e = {
            h.missed.note("c", None, 10);
            let Begin::Mine(_held) = begin(&h) else {
                panic!("this caller replays")
            };
            enter_async(&h, Duration::from_millis(20), |_| async {})
                .await
                .unwrap_err()
        };
        assert!(e.to_string().contains("still running"), "{e}");
    }
}
