//! One shard of the memory backend: a hash table of slot numbers, the slots (key and value in one
//! allocation each), a byte budget, and the CLOCK hand that picks what to evict.

use std::hash::{BuildHasher, RandomState};

use bytes::Bytes;
use hashbrown::HashTable;

/// What an entry is charged beside its key and value: its slot (56 bytes), its share of the hash
/// table (4-byte index and control byte, at most 7/8 full), the shared buffer's reference count
/// (24 bytes, allocated when the entry is stored) and the allocator's headers and rounding of the
/// two allocations. The `memory` bench compares it with the heap really used.
pub(super) const ENTRY_OVERHEAD: usize = 112;

/// One stored item.
#[derive(Debug)]
pub(super) struct Slot {
    /// The key's bytes, then the value's: one buffer per entry, shared (not copied) with every
    /// reader of the value.
    data: Bytes,
    pub(super) cas: u64,
    /// Unix milliseconds at which the item is gone; 0 = never.
    pub(super) deadline_ms: u64,
    pub(super) flags: u32,
    /// Keys are at most 250 bytes (memcached's rule, checked before a store).
    key_len: u8,
    /// CLOCK's reference bit: set by every use, cleared when the hand passes. An entry the hand
    /// finds clear has not been used for a whole turn of the hand, and goes.
    referenced: bool,
}

impl Slot {
    pub(super) fn new(key: &str, value: &[u8], flags: u32, cas: u64, deadline_ms: u64) -> Slot {
        let mut data = Vec::with_capacity(key.len() + value.len());
        data.extend_from_slice(key.as_bytes());
        data.extend_from_slice(value);
        let data = Bytes::from(data);
        // A buffer made from a `Vec` gets its shared reference count at its first clone, which
        // would make the first read allocate under the shard's lock: make it now.
        drop(data.clone());
        Slot {
            data,
            cas,
            deadline_ms,
            flags,
            key_len: u8::try_from(key.len()).expect("keys are at most 250 bytes"),
            referenced: false,
        }
    }

    fn key(&self) -> &[u8] {
        &self.data[..usize::from(self.key_len)]
    }

    pub(super) fn value(&self) -> &[u8] {
        &self.data[usize::from(self.key_len)..]
    }

    /// What a read of this entry returns: its value (shared, not copied), flags and CAS.
    pub(super) fn item(&self) -> crate::backend::Item {
        crate::backend::Item {
            value: self.data.slice(usize::from(self.key_len)..),
            flags: self.flags,
            cas: self.cas,
        }
    }

    fn live(&self, now_ms: u64) -> bool {
        self.deadline_ms == 0 || now_ms < self.deadline_ms
    }

    fn cost(&self) -> usize {
        self.data.len() + ENTRY_OVERHEAD
    }
}

// The footprint ENTRY_OVERHEAD charges for: a slot stays 56 bytes (the buffer's vtable pointer is
// the niche of the Option) on 64-bit targets.
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Option<Slot>>() == 56);

/// A part of the key space with its own lock and its own share of the capacity.
#[derive(Debug)]
pub(super) struct Shard {
    /// Slot numbers, hashed by their slot's key.
    table: HashTable<u32>,
    slots: Vec<Option<Slot>>,
    /// Empty slots, reused before `slots` grows.
    free: Vec<u32>,
    /// The CLOCK hand: the next slot eviction looks at.
    hand: usize,
    /// What the entries are charged ([`Slot::cost`]); never above `capacity`.
    bytes: usize,
    capacity: usize,
    hasher: RandomState,
}

impl Shard {
    pub(super) fn new(capacity: usize, hasher: RandomState) -> Shard {
        Shard {
            table: HashTable::new(),
            slots: Vec::new(),
            free: Vec::new(),
            hand: 0,
            bytes: 0,
            capacity,
            hasher,
        }
    }

    fn find(&self, hash: u64, key: &str) -> Option<u32> {
        let slots = &self.slots;
        self.table
            .find(hash, |&i| {
                slots[i as usize]
                    .as_ref()
                    .is_some_and(|s| s.key() == key.as_bytes())
            })
            .copied()
    }

    /// The live entry under `key`, marked used; an expired one is removed on the way
    /// (memcached's lazy expiry).
    pub(super) fn live_mut(&mut self, hash: u64, key: &str, now_ms: u64) -> Option<&mut Slot> {
        let i = self.find(hash, key)?;
        let live = self.slots[i as usize]
            .as_ref()
            .is_some_and(|s| s.live(now_ms));
        if !live {
            self.remove_slot(hash, i);
            return None;
        }
        let slot = self.slots[i as usize].as_mut()?;
        if !slot.referenced {
            slot.referenced = true;
        }
        Some(slot)
    }

    /// Removes what is under `key`, live or expired; `true` if it was live.
    pub(super) fn remove(&mut self, hash: u64, key: &str, now_ms: u64) -> bool {
        let Some(i) = self.find(hash, key) else {
            return false;
        };
        self.remove_slot(hash, i).is_some_and(|s| s.live(now_ms))
    }

    fn remove_slot(&mut self, hash: u64, i: u32) -> Option<Slot> {
        if let Ok(entry) = self.table.find_entry(hash, |&j| j == i) {
            entry.remove();
        }
        let slot = self.slots[i as usize].take()?;
        self.bytes -= slot.cost();
        self.free.push(i);
        Some(slot)
    }

    /// Stores `slot` under its key, replacing what was there, evicting until it fits. The caller
    /// has checked that it fits in an empty shard.
    pub(super) fn insert(&mut self, hash: u64, key: &str, mut slot: Slot, now_ms: u64) {
        debug_assert!(slot.cost() <= self.capacity && slot.key() == key.as_bytes());
        if let Some(i) = self.find(hash, key) {
            // A rewrite counts as a use.
            slot.referenced = true;
            self.remove_slot(hash, i);
        }
        while self.bytes + slot.cost() > self.capacity && self.evict_one(now_ms) {}
        self.bytes += slot.cost();
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = Some(slot);
                i
            }
            None => {
                self.slots.push(Some(slot));
                u32::try_from(self.slots.len() - 1).expect("under 2^32 entries per shard")
            }
        };
        let (slots, hasher) = (&self.slots, &self.hasher);
        self.table.insert_unique(hash, i, |&j| {
            hasher.hash_one(slots[j as usize].as_ref().map_or(&[][..], |s| s.key()))
        });
    }

    /// CLOCK (second chance): the hand sweeps the slots, clearing reference bits, and evicts the
    /// first entry that is expired or was not used since the hand last passed it. `false` if the
    /// shard is empty.
    fn evict_one(&mut self, now_ms: u64) -> bool {
        let n = self.slots.len();
        // Two turns: the first may only clear bits; the second then finds a clear one.
        for _ in 0..=2 * n {
            if self.hand >= n {
                self.hand = 0;
            }
            let i = self.hand;
            self.hand += 1;
            let Some(slot) = self.slots[i].as_mut() else {
                continue;
            };
            if slot.referenced && slot.live(now_ms) {
                slot.referenced = false;
                continue;
            }
            let hash = self.hasher.hash_one(slot.key());
            self.remove_slot(hash, i as u32);
            return true;
        }
        false
    }

    /// Rewrites the value of a live entry in place of the old one, keeping its flags and expiry
    /// (memcached's `incr`/`decr`).
    pub(super) fn rewrite(&mut self, hash: u64, key: &str, value: &[u8], cas: u64, now_ms: u64) {
        let Some(old) = self.live_mut(hash, key, now_ms) else {
            return;
        };
        let slot = Slot::new(key, value, old.flags, cas, old.deadline_ms);
        self.insert(hash, key, slot, now_ms);
    }

    /// The bytes charged to the entries held.
    #[cfg(test)]
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }
}
