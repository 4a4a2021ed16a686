//! In-process coalescing: concurrent callers for one key share one leader's work. The leader holds
//! a guard whose `Drop` wakes the waiters even if the leader errors or panics, and every wait is
//! bounded.

use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use crate::error::Error;

/// A shared, type-erased value (the cache hands out clones of the `T` inside).
pub(crate) type AnyValue = Arc<dyn Any + Send + Sync>;

/// What a leader hands to the callers that waited for it.
#[derive(Clone)]
pub(crate) enum Outcome {
    /// Still being worked on.
    Pending,
    /// A value the leader's call came to: loaded (by it, or by the caller it waited for).
    Value(AnyValue),
    /// A value that was there when the leader looked (the stale value it serves while it
    /// refreshes, or what another caller's claim left): its followers were answered at once,
    /// not after a load.
    Served(AnyValue),
    /// The leader's call failed; waiters get the same error (sharing its source).
    Failed(Error),
    /// The leader went away without an answer (it panicked, or gave up): retry.
    Abandoned,
}

/// Who leads a call: what a follower's wait depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Leading {
    /// A sync caller: its own thread runs the load, whoever waits for it.
    Thread,
    /// An async task, polled on `ThreadId` when it took the lead: it needs its runtime's threads
    /// to make progress (on a current-thread runtime, that one).
    #[cfg(feature = "tokio")]
    Task(std::thread::ThreadId),
}

/// One coalesced call on a key: who leads it, and the outcome its followers wait for.
pub(crate) struct InFlight {
    /// Who leads this call.
    pub(crate) leading: Leading,
    outcome: Mutex<Option<Outcome>>,
    ready: Condvar,
    /// Wakes the followers of `AsyncCache` (the sync ones wait on `ready`).
    #[cfg(feature = "tokio")]
    notify: tokio::sync::Notify,
}

impl InFlight {
    fn new(leading: Leading) -> InFlight {
        InFlight {
            leading,
            outcome: Mutex::default(),
            ready: Condvar::new(),
            #[cfg(feature = "tokio")]
            notify: tokio::sync::Notify::new(),
        }
    }

    /// Waits for the leader's outcome until `deadline`; `Pending` if the wait timed out.
    pub(crate) fn wait(&self, deadline: Instant) -> Outcome {
        let mut o = self.outcome.lock();
        while o.is_none() {
            if self.ready.wait_until(&mut o, deadline).timed_out() {
                break;
            }
        }
        o.clone().unwrap_or(Outcome::Pending)
    }

    /// [`wait`](InFlight::wait) for a task: the outcome, or `Pending` at `deadline`.
    #[cfg(feature = "tokio")]
    pub(crate) async fn wait_async(&self, deadline: Instant) -> Outcome {
        loop {
            // Registered before the check, so that a publish in between is not missed.
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(o) = self.outcome.lock().clone() {
                return o;
            }
            let deadline = tokio::time::Instant::from_std(deadline);
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.outcome.lock().clone().unwrap_or(Outcome::Pending);
            }
        }
    }
}

/// The table of keys with a leader at work.
#[derive(Default)]
pub(crate) struct Coalescer {
    calls: Mutex<HashMap<String, Arc<InFlight>>>,
}

impl std::fmt::Debug for Coalescer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coalescer")
            .field("in_flight", &self.calls.lock().len())
            .finish()
    }
}

/// A caller's part in a coalesced call.
pub(crate) enum Role<'a> {
    /// Do the work, then [`Leader::publish`].
    Leader(Leader<'a>),
    /// Wait on the call.
    Follower(Arc<InFlight>),
}

impl Coalescer {
    /// Joins the call for `key`: the first caller leads (as `leading` says), the rest follow.
    pub(crate) fn join(&self, key: &str, leading: Leading) -> Role<'_> {
        let mut calls = self.calls.lock();
        if let Some(call) = calls.get(key) {
            return Role::Follower(call.clone());
        }
        let call = Arc::new(InFlight::new(leading));
        calls.insert(key.to_string(), call.clone());
        Role::Leader(Leader {
            coalescer: self,
            key: key.to_string(),
            call,
            published: false,
        })
    }
}

impl Coalescer {
    /// Takes `key`'s call out of the table (only if it is `only`, when given): callers arriving
    /// now start a new call instead of joining one that may have read what a write just
    /// replaced. The leader and its followers carry on with their own call.
    pub(crate) fn detach(&self, key: &str, only: Option<&Arc<InFlight>>) {
        let mut calls = self.calls.lock();
        if calls
            .get(key)
            .is_some_and(|s| only.is_none_or(|o| Arc::ptr_eq(s, o)))
        {
            calls.remove(key);
        }
    }
}

/// The leader's guard: publishing (or dropping) it removes the key from the table and wakes every
/// follower. Callers arriving after that start a new call.
pub(crate) struct Leader<'a> {
    coalescer: &'a Coalescer,
    key: String,
    call: Arc<InFlight>,
    published: bool,
}

impl Leader<'_> {
    /// Hands `outcome` to the followers. May be called early (a stale value before a refresh);
    /// later calls are ignored.
    pub(crate) fn publish(&mut self, outcome: Outcome) {
        if self.published {
            return;
        }
        self.published = true;
        self.coalescer.detach(&self.key, Some(&self.call));
        *self.call.outcome.lock() = Some(outcome);
        self.call.ready.notify_all();
        #[cfg(feature = "tokio")]
        self.call.notify.notify_waiters();
    }
}

impl Drop for Leader<'_> {
    fn drop(&mut self) {
        // An error path that forgot to publish, or a panicking loader: never leave anyone waiting.
        self.publish(Outcome::Abandoned);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn one_leader_many_followers() {
        let c = Coalescer::default();
        let Role::Leader(mut leader) = c.join("k", Leading::Thread) else {
            panic!("first caller leads")
        };
        let followers: Vec<_> = (0..4)
            .map(|_| match c.join("k", Leading::Thread) {
                Role::Follower(s) => s,
                Role::Leader(_) => panic!("second caller must follow"),
            })
            .collect();
        leader.publish(Outcome::Value(Arc::new(7u32)));
        for f in followers {
            let Outcome::Value(v) = f.wait(Instant::now() + Duration::from_secs(1)) else {
                panic!("value expected")
            };
            assert_eq!(v.downcast_ref::<u32>(), Some(&7));
        }
        assert!(
            matches!(c.join("k", Leading::Thread), Role::Leader(_)),
            "a new call after publishing"
        );
    }

    #[test]
    fn a_panicking_leader_wakes_its_followers() {
        let c = Coalescer::default();
        let follower = std::thread::scope(|s| {
            let Role::Leader(leader) = c.join("k", Leading::Thread) else {
                panic!()
            };
            let Role::Follower(call) = c.join("k", Leading::Thread) else {
                panic!()
            };
            let r = s.spawn(move || {
                let _guard = leader;
                panic!("loader panicked");
            });
            assert!(r.join().is_err());
            call
        });
        let t = Instant::now();
        assert!(matches!(
            follower.wait(Instant::now() + Duration::from_secs(5)),
            Outcome::Abandoned
        ));
        assert!(t.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn waits_are_bounded() {
        let c = Coalescer::default();
        let _leader = c.join("k", Leading::Thread);
        let Role::Follower(call) = c.join("k", Leading::Thread) else {
            panic!()
        };
        let t = Instant::now();
        assert!(matches!(
            call.wait(Instant::now() + Duration::from_millis(50)),
            Outcome::Pending
        ));
        assert!(t.elapsed() >= Duration::from_millis(50));
    }
}
