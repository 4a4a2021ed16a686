//! The tests' own helpers, shared by the unit tests (`mod test_support` in lib.rs) and the
//! integration tests (`tests/it/main.rs` includes this file by path).

/// Runs `f` under `subscriber` on this thread.
///
/// Two gaps of tracing-core's interest cache are closed. Every callsite's interest is rebuilt
/// once `subscriber` is registered: a callsite that another test's thread registered while
/// only other subscribers were alive cached "never", and would stay silent here. And a second
/// dispatcher (a `NoSubscriber`) is kept alive for good: while exactly one is registered,
/// tracing-core asks the *registering* thread's default for a new callsite's interest, so a
/// callsite another thread hits first during `f` (none there: "never") would be silenced
/// (tokio-rs/tracing#3611).
pub(crate) fn scoped<S, R>(subscriber: S, f: impl FnOnce() -> R) -> R
where
    S: tracing::Subscriber + Send + Sync + 'static,
{
    static NEVER_JUST_ONE: std::sync::OnceLock<tracing::Dispatch> = std::sync::OnceLock::new();
    NEVER_JUST_ONE
        .get_or_init(|| tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default()));
    tracing::subscriber::with_default(subscriber, || {
        tracing::callsite::rebuild_interest_cache();
        f()
    })
}
