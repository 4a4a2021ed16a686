//! CPU time per call, by side: this process's (every thread: the runtime's workers, the
//! connections' tasks) and the server's, read from Linux's `/proc/<pid>/task/*/schedstat`
//! (nanoseconds on the CPU) around each side's slice, and printed once a path is done. What
//! the wall-clock ratios cannot say on 2 cores the client and the server share: where the
//! cycles go. Also the times each side's threads were put on a CPU, and this process's split
//! of its CPU into user and system time (`/proc/self/stat`, sampled by the kernel's ticks).
//! Nothing on a system without `/proc` (the figures read 0).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

/// The measured servers' pids, once known (none: the server figure reads 0).
static SERVERS: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// The thread id of `--busy-core`'s spinning thread (0: none), left out of this process's CPU.
static SPINNER: AtomicU32 = AtomicU32::new(0);

/// Keeps one core busy until the process ends (`--busy-core`): a thread spinning, whose CPU
/// time is not counted as the client's.
pub fn spin_one_core() {
    std::thread::spawn(|| {
        let tid = std::fs::read_link("/proc/thread-self")
            .ok()
            .and_then(|p| p.file_name()?.to_str()?.parse::<u32>().ok());
        // No id (no `/proc`): one that matches no thread.
        SPINNER.store(tid.unwrap_or(u32::MAX), Ordering::Relaxed);
        loop {
            std::hint::spin_loop();
        }
    });
    // Its id known before anything is measured.
    while SPINNER.load(Ordering::Relaxed) == 0 {
        std::thread::yield_now();
    }
}

/// Counts the server `pid`'s CPU time from now on (beside the others watched: a path's
/// servers are summed).
pub fn watch_server(pid: u32) {
    SERVERS.lock().unwrap_or_else(|e| e.into_inner()).push(pid);
}

/// Nanoseconds on the CPU of every thread of process `pid` so far (but `--busy-core`'s), and
/// how many times they were put on a CPU (`schedstat`'s third field: a thread that sleeps
/// and is woken counts one each time; so does one preempted and resumed).
fn on_cpu(pid: &str) -> [u64; 2] {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return [0; 2];
    };
    let spinner = SPINNER.load(Ordering::Relaxed).to_string();
    tasks
        .filter_map(|t| t.ok())
        .filter(|t| t.file_name().to_str() != Some(spinner.as_str()))
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .map(|s| {
            let mut f = s.split_whitespace().map(|f| f.parse::<u64>().unwrap_or(0));
            let ns = f.next().unwrap_or(0);
            [ns, f.nth(1).unwrap_or(0)]
        })
        .fold([0; 2], add)
}

/// Two counts summed, field by field.
fn add(a: [u64; 2], b: [u64; 2]) -> [u64; 2] {
    [a[0] + b[0], a[1] + b[1]]
}

/// User and system time of this process so far, in nanoseconds: `/proc/self/stat`'s `utime`
/// and `stime`, in Linux's `USER_HZ` of 100 a second. The kernel charges each of its scheduler
/// ticks (4 ms here) wholly to one or the other, so the split is a sample: good to a few
/// percent over a whole side's CPU of a path, noisy for a side that spends little. With
/// `--busy-core` the spinning thread is in it ([`Spent::per_call`] then leaves it out).
fn user_system() -> [u64; 2] {
    let Ok(s) = std::fs::read_to_string("/proc/self/stat") else {
        return [0; 2];
    };
    // After the name (in parentheses, perhaps with spaces) come the fields from the third on:
    // `utime` is the 14th, `stime` the 15th.
    let rest = s.rsplit_once(')').map_or("", |(_, rest)| rest);
    let mut f = rest.split_whitespace().skip(11);
    let mut tick = || f.next().and_then(|t| t.parse::<u64>().ok()).unwrap_or(0) * 10_000_000;
    [tick(), tick()]
}

/// This process's and the server's CPU nanoseconds, then their times put on a CPU, then this
/// process's user and system nanoseconds, so far.
pub fn now() -> [u64; 6] {
    let servers = SERVERS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let server = servers
        .iter()
        .map(|pid| on_cpu(&pid.to_string()))
        .fold([0; 2], add);
    let client = on_cpu("self");
    let [user, system] = user_system();
    [client[0], server[0], client[1], server[1], user, system]
}

/// CPU time a side spent, the times its threads were put on a CPU, and its calls.
#[derive(Debug, Default, Clone, Copy)]
pub struct Spent {
    /// The client's and the server's nanoseconds on a CPU, then their times put on one, then
    /// the client's user and system nanoseconds.
    pub totals: [u64; 6],
    pub ops: u64,
}

impl Spent {
    pub fn add(&mut self, before: [u64; 6], after: [u64; 6], ops: usize) {
        for i in 0..6 {
            self.totals[i] += after[i].saturating_sub(before[i]);
        }
        self.ops += ops as u64;
    }

    /// `client X us + server Y us = Z us of CPU per call; put on a CPU: client A, server B
    /// per call; client user U%, system S%` (the split sampled: [`user_system`]).
    pub fn per_call(&self) -> String {
        let per = |n: u64| n as f64 / self.ops.max(1) as f64;
        let [c, s, cs, ss, u, k] = self.totals;
        let split = match SPINNER.load(Ordering::Relaxed) {
            0 => format!(
                "client user {:.0}%, system {:.0}% (sampled)",
                100.0 * u as f64 / (u + k).max(1) as f64,
                100.0 * k as f64 / (u + k).max(1) as f64
            ),
            _ => "client user/system not split (--busy-core)".to_string(),
        };
        format!(
            "client {:.2} us + server {:.2} us = {:.2} us CPU per call; put on a CPU: client {:.3}, server {:.3} per call; {split}",
            per(c) / 1e3,
            per(s) / 1e3,
            per(c + s) / 1e3,
            per(cs),
            per(ss),
        )
    }
}
