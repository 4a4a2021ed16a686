//! The write log both peers of the `gets` figure share: a file (in /dev/shm, else the temp dir) that each maps, in
//! which a writer records when each generation of each rewritten key was written (CLOCK_MONOTONIC
//! ns, after its `set` returned), so that a reader in either process judges a read at once,
//! without waiting for word from the other.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::bus::values::KEYS;
use crate::floor::items::BoxError;

/// Generations kept per key: a read older than this many generations is stale in any case.
const RING: usize = 8192;
/// The rewritten keys: every 50th.
const REWRITTEN: usize = KEYS / 50;
/// Tiers times variants.
pub const COMBOS: usize = 6;
/// Per key: the latest generation, then the ring of return times.
const PER_KEY: usize = 1 + RING;
const WORDS: usize = COMBOS * REWRITTEN * PER_KEY;

/// A mapped log.
pub struct WriteLog {
    words: *const AtomicU64,
    _file: File,
}

// SAFETY: the mapping is only read and written through atomics, and lives as long as `self`.
unsafe impl Send for WriteLog {}
unsafe impl Sync for WriteLog {}

/// What the log knows of a generation's successor.
pub enum Next {
    /// Not written (as far as the log knows).
    Unwritten,
    /// Written, and its `set` returned at this instant.
    At(u64),
    /// Written so long ago that its instant is gone from the ring.
    LongAgo,
}

impl WriteLog {
    /// A new log at `path` (zeroed: no key written).
    pub fn create(path: &Path) -> Result<WriteLog, BoxError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        file.set_len((WORDS * 8) as u64)?;
        Self::map(file)
    }

    /// The log at `path`, made by [`create`](WriteLog::create).
    pub fn open(path: &Path) -> Result<WriteLog, BoxError> {
        Self::map(OpenOptions::new().read(true).write(true).open(path)?)
    }

    fn map(file: File) -> Result<WriteLog, BoxError> {
        // SAFETY: a shared mapping of the whole file, whose length is WORDS * 8 bytes.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                WORDS * 8,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(WriteLog {
            words: p.cast(),
            _file: file,
        })
    }

    fn key(&self, combo: usize, i: usize) -> &[AtomicU64] {
        assert!(combo < COMBOS && i.is_multiple_of(50) && i < KEYS);
        let start = (combo * REWRITTEN + i / 50) * PER_KEY;
        // SAFETY: within the mapping (checked above), which outlives `&self`.
        unsafe { std::slice::from_raw_parts(self.words.add(start), PER_KEY) }
    }

    /// Generation `g` of key `i` was written; its `set` returned `at`.
    pub fn record(&self, combo: usize, i: usize, g: u64, at: u64) {
        let k = self.key(combo, i);
        k[1 + (g as usize % RING)].store(at, Ordering::Release);
        k[0].fetch_max(g, Ordering::Release);
    }

    /// When generation `g + 1` of key `i` was written.
    pub fn next(&self, combo: usize, i: usize, g: u64) -> Next {
        let k = self.key(combo, i);
        let latest = k[0].load(Ordering::Acquire);
        match latest {
            l if l <= g => Next::Unwritten,
            l if l - g > RING as u64 / 2 => Next::LongAgo,
            _ => Next::At(k[1 + ((g + 1) as usize % RING)].load(Ordering::Acquire)),
        }
    }
}

impl Drop for WriteLog {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, no longer used.
        unsafe { libc::munmap(self.words as *mut libc::c_void, WORDS * 8) };
    }
}
