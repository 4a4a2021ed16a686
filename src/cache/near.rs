//! The near tier as the facade uses it: a hit decoded and counted, a fill from what a shared
//! read found, and a copy served while the shared store does not answer.

use std::any::Any;
use std::sync::Arc;

use serde::de::DeserializeOwned;

use super::Cache;
use crate::codec::Decode;
use crate::envelope::Header;
use crate::near::fence::Ticket;
use crate::near::{Copy, Fill};
use crate::protocol::Servable;
use crate::stats::Counters;

impl Cache {
    /// `key`'s copy decoded as a `T` when it is served as a hit (counted); otherwise the
    /// current copy, if any, for [`near_outage`](Cache::near_outage). `Err(None)` without a
    /// near tier.
    #[inline]
    pub(crate) fn near_hit<T: Decode>(&self, key: &str) -> Result<T, Option<Arc<Copy>>> {
        let c = self.near_copy(key)?;
        match self.decode_copy::<T>(&c) {
            Some(v) => {
                self.near_counted();
                Ok(v)
            }
            None => Err(None),
        }
    }

    /// [`near_hit`](Cache::near_hit) counting nothing (the caller counts what it serves).
    #[cfg(feature = "tower")]
    pub(crate) fn near_peek<T: Decode>(&self, key: &str) -> Option<T> {
        let c = self.near_serves(key).ok()?;
        self.decode_copy::<T>(&c)
    }

    /// [`near_hit`](Cache::near_hit) as a shared value: the one the copy keeps (decoded once
    /// per copy, for the first type it is read as with `get_arc`; charged to the near tier), or
    /// decoded now.
    #[inline]
    pub(crate) fn near_hit_arc<T: DeserializeOwned + Send + Sync + 'static>(
        &self,
        key: &str,
    ) -> Result<Arc<T>, Option<Arc<Copy>>> {
        let c = self.near_copy(key)?;
        if let Some(v) = c.decoded::<T>() {
            self.near_counted();
            return Ok(v);
        }
        let h = &c.header;
        let decoded = T::decode_charged(
            &self.inner.config.format,
            h.codec,
            h.payload(),
            &c.payload,
            &c.payload,
        );
        match decoded {
            Ok((v, charge)) => {
                let v = Arc::new(v);
                if !c.keeps_decoded() {
                    self.near_keep(key, &c, v.clone(), charge);
                }
                self.near_counted();
                Ok(v)
            }
            Err(_) => Err(None),
        }
    }

    /// Keeps `v`, `copy`'s payload decoded (`charge`: what it allocated), in `key`'s copy.
    pub(crate) fn near_keep<T: Send + Sync + 'static>(
        &self,
        key: &str,
        copy: &Copy,
        v: Arc<T>,
        charge: usize,
    ) {
        if let Some(near) = &self.inner.near {
            let decoded = (std::any::TypeId::of::<T>(), v as Arc<dyn Any + Send + Sync>);
            near.keep(self.keys.version, key, copy, decoded, charge, &self.stats);
        }
    }

    /// The copy of `key` a hit is served from; otherwise (counted as a near miss) the current
    /// copy past its near ttl or its freshness, if any.
    #[inline]
    fn near_copy(&self, key: &str) -> Result<Arc<Copy>, Option<Arc<Copy>>> {
        let found = self.near_serves(key);
        if found.is_err() && self.inner.near.is_some() {
            Counters::bump(&self.stats.near_misses);
        }
        found
    }

    /// [`near_copy`](Cache::near_copy) counting nothing.
    #[inline]
    fn near_serves(&self, key: &str) -> Result<Arc<Copy>, Option<Arc<Copy>>> {
        let Some(near) = &self.inner.near else {
            return Err(None);
        };
        match near.current(self.keys.version, key) {
            Some(c) if near.serves(&c) => Ok(c),
            kept => Err(kept),
        }
    }

    pub(crate) fn near_counted(&self) {
        Counters::bump(&self.stats.near_hits);
    }

    /// The copy's payload as a `T`; `None` if it is not one (the whole way reports why).
    fn decode_copy<T: Decode>(&self, c: &Copy) -> Option<T> {
        self.decode_payload::<T>(&c.header, &c.payload, &c.payload)
            .ok()
    }

    /// A ticket for a read of derived key `derived` about to be sent; `None` without a near
    /// tier, or while a write to the key may still land.
    #[inline]
    pub(crate) fn near_ticket(&self, derived: &str) -> Option<Ticket> {
        self.inner.near.as_ref()?.ticket(derived)
    }

    /// Fills `key`'s copy with a value a read sent under `ticket` found fresh.
    pub(crate) fn near_fill(
        &self,
        key: &str,
        ticket: Ticket,
        held: &Servable,
    ) -> Option<Arc<Copy>> {
        let near = self.inner.near.as_ref()?;
        let (header, payload) = self.near_payload(held.header, &held.item.value[held.offset..])?;
        let fill = Fill {
            ticket,
            writes: 0,
            header,
            payload: &payload,
        };
        near.fill(self.keys.version, key, fill, None, &self.stats)
    }

    /// What a copy holds of a payload: the payload, decompressed if it was compressed (a copy
    /// is read many times); `None` if it does not decompress.
    fn near_payload<'p>(
        &self,
        header: Header,
        payload: &'p [u8],
    ) -> Option<(Header, std::borrow::Cow<'p, [u8]>)> {
        if header.raw || !header.compressed {
            return Some((header, payload.into()));
        }
        let plain = self.inner.config.format.decompress(payload).ok()?;
        let header = Header {
            compressed: false,
            ..header
        };
        Some((header, plain.into()))
    }

    /// Fills `key`'s copy with an envelope this process wrote itself under `ticket` (a
    /// load's store that was stored: `writes` 1), or could not write (the store down: 0).
    pub(crate) fn near_fill_written(&self, key: &str, ticket: Ticket, writes: u64, item: &[u8]) {
        let Some(near) = &self.inner.near else {
            return;
        };
        let Ok(crate::envelope::Parsed::Item(header, payload)) =
            crate::envelope::decode(crate::envelope::FLAGS, item)
        else {
            return;
        };
        let Some((header, payload)) = self.near_payload(header, payload) else {
            return;
        };
        let fill = Fill {
            ticket,
            writes,
            header,
            payload: &payload,
        };
        near.fill(self.keys.version, key, fill, None, &self.stats);
    }

    /// A copy served because the shared store did not answer: within its staleness bound
    /// (and computed at most `serve_stale_on_error`'s `max_age` ago); counted (as a hit while
    /// still fresh, as a stale value served after) and logged once.
    pub(crate) fn near_outage<T: Decode>(&self, kept: Option<&Arc<Copy>>) -> Option<T> {
        let (near, c) = (self.inner.near.as_ref()?, kept?);
        if !self.young_enough(c.header.written_ms) || !near.serves_in_outage(c) {
            return None;
        }
        let v = self.decode_copy::<T>(c)?;
        Counters::bump(&self.stats.near_outage_served);
        let stale = self.now_ms() >= c.header.soft_expiry_ms;
        self.count_served(stale);
        near.outage_served();
        Some(v)
    }

    /// Decodes a servable value with what it allocates.
    pub(crate) fn decode_servable_charged<T: Decode>(
        &self,
        held: &Servable,
    ) -> crate::Result<(T, usize)> {
        let value = &held.item.value;
        let h: &Header = &held.header;
        T::decode_charged(
            &self.inner.config.format,
            h.codec,
            h.payload(),
            value,
            &value[held.offset..],
        )
    }
}
