//! Value serialization: the [`Codec`]s and opt-in [`Compression`] a cache writes with, and the
//! bounded decoding every read goes through. Pure: bytes in, bytes out.
//!
//! The envelope records which codec wrote a payload and whether it is compressed, so a reader
//! decodes by what it finds, not by what it is configured to write: caches configured with
//! different codecs (two builds in a rolling deploy) read each other's values.

mod bounded;
mod charge;
mod msgpack;

use bytes::Bytes;
use serde::Serialize;
use serde::de::{DeserializeOwned, DeserializeSeed};

use crate::error::{Error, ErrorKind, Result};

/// How values are serialized. Set with [`CacheBuilder::codec`](crate::CacheBuilder::codec).
///
/// Whatever the setting, a reader decodes each value with the codec that wrote it (the envelope
/// records it), so changing the codec is itself a safe rolling deploy.
///
/// # What stays compatible across a deploy that changes a struct
///
/// | change to a cached struct | `MessagePack` (default) | `Bincode` |
/// |---|---|---|
/// | add a field with `#[serde(default)]` | old values read, field defaulted | decode error\* |
/// | remove a field | old values read, field ignored | decode error\* |
/// | reorder fields | compatible | wrong values or decode error\* |
/// | add an `Option` field (no attribute needed) | old values read, field `None` | decode error\* |
/// | add a field without a default (not an `Option`) | decode error\* | decode error\* |
/// | add an enum variant | new values are a decode error\* for old builds | same |
/// | rename a field or variant | decode error\* | compatible only if the order is kept |
///
/// \* a decode error is returned (or a miss, with [`DecodePolicy::Miss`](crate::DecodePolicy)).
/// With `Bincode`, bump the cache version ([`CacheBuilder::version`](crate::CacheBuilder::version))
/// whenever a cached struct changes. `Bincode` cannot carry serde's self-describing shapes at all
/// (`#[serde(flatten)]`, untagged and internally tagged enums, `skip_serializing_if`);
/// `MessagePack` carries them, `Vec<u8>` fields included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Codec {
    /// MessagePack through `rmp-serde`, structs as maps with named fields, byte sequences
    /// (`Vec<u8>`, `bytes::Bytes`, `serde_bytes`) as MessagePack binary. Self-describing: tolerant
    /// of added (defaulted) and removed fields, and readable from Python, PHP, Go...
    #[default]
    MessagePack,
    /// bincode 2, standard configuration: compact and positional. Any change to a cached type
    /// needs a version bump.
    Bincode,
}

impl Codec {
    /// The id the envelope records.
    pub(crate) fn id(self) -> u8 {
        match self {
            Codec::Bincode => 0,
            Codec::MessagePack => 1,
        }
    }

    /// The codec an envelope's id names (`None`: written by a newer build).
    pub(crate) fn from_id(id: u8) -> Option<Codec> {
        match id {
            0 => Some(Codec::Bincode),
            1 => Some(Codec::MessagePack),
            _ => None,
        }
    }
}

/// Opt-in compression of large payloads. Set with
/// [`CacheBuilder::compression`](crate::CacheBuilder::compression); off by default.
///
/// A compressed payload is marked in the envelope (flags bit 0), so it is never silent: every
/// newcache build reads it, whatever its own setting, and a foreign client sees the flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Compression {
    /// Never compress.
    #[default]
    Off,
    /// LZ4 (block format, `lz4_flex`), for payloads of at least `min_size` encoded bytes, and only
    /// when it saves space.
    Lz4 {
        /// Payloads smaller than this are stored as they are.
        min_size: usize,
    },
}

/// The default [`CacheBuilder::max_decode_size`](crate::CacheBuilder::max_decode_size): 64 MiB.
pub const DEFAULT_MAX_DECODE_SIZE: usize = 64 << 20;

/// How a cache writes and reads payloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Format {
    pub(crate) codec: Codec,
    pub(crate) compression: Compression,
    /// The most a decode may allocate, in bytes.
    pub(crate) max_decode: usize,
}

impl Default for Format {
    fn default() -> Self {
        Format {
            codec: Codec::default(),
            compression: Compression::default(),
            max_decode: DEFAULT_MAX_DECODE_SIZE,
        }
    }
}

/// A value as the write path stores it. Every `Serialize` type is encoded by the cache's
/// [`Format`]; a crate type may instead store its own bytes as they are (a *raw* payload, marked
/// in the envelope), which the response cache does with page bodies, so that a body is copied
/// into the item once instead of being walked byte by byte by a serializer.
pub(crate) trait Encode {
    /// Appends the payload to `out`; says how it is encoded.
    fn encode_payload(&self, format: &Format, out: &mut Vec<u8>) -> Result<Payload>;
    /// The lifetime this value asks for, over the one the caller passed (a page whose response
    /// said `max-age`); `None`: the caller's.
    fn lifetime(&self) -> Option<std::time::Duration> {
        None
    }
    /// Whether it may be served stale, past its lifetime, while one caller refreshes it (the
    /// herd's grace); `false` (a page whose response said `must-revalidate`) stores it with no
    /// grace: once expired, readers wait for the one refresh as for a missing key.
    fn serve_stale(&self) -> bool {
        true
    }
}

/// How a payload is encoded, as the envelope records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Payload {
    /// By the format's codec, as it is.
    Coded,
    /// By the format's codec, then LZ4-compressed.
    Compressed,
    /// The value's own bytes, read back by the same type (no codec).
    Raw,
}

/// A value as the read path decodes it: the inverse of [`Encode`].
pub(crate) trait Decode: Sized {
    /// Decodes a payload written by `codec` (and compressed, or raw, as the envelope says).
    /// `payload` lies within `item`, the bytes read: a raw value may keep parts of it without a
    /// copy (`item.slice_ref`); a codec's value only borrows it.
    fn decode_payload(
        format: &Format,
        codec: Codec,
        how: Payload,
        item: &Bytes,
        payload: &[u8],
    ) -> Result<Self>;

    /// [`decode_payload`](Decode::decode_payload), and what the value holds in memory (what
    /// decoding allocated, or, for a type that does not count, its size and the payload's).
    fn decode_charged(
        format: &Format,
        codec: Codec,
        how: Payload,
        item: &Bytes,
        payload: &[u8],
    ) -> Result<(Self, usize)> {
        Self::decode_payload(format, codec, how, item, payload)
            .map(|v| (v, size_of::<Self>() + payload.len()))
    }
}

impl<T: Serialize + ?Sized> Encode for T {
    fn encode_payload(&self, format: &Format, out: &mut Vec<u8>) -> Result<Payload> {
        Ok(if format.encode_into(self, out)? {
            Payload::Compressed
        } else {
            Payload::Coded
        })
    }
}

impl<T: DeserializeOwned> Decode for T {
    fn decode_payload(
        format: &Format,
        codec: Codec,
        how: Payload,
        _: &Bytes,
        payload: &[u8],
    ) -> Result<Self> {
        match how {
            Payload::Raw => Err(Error::decode(format!(
                "the stored value is raw bytes, not a `{}`",
                std::any::type_name::<T>()
            ))),
            how => format.decode(codec, how == Payload::Compressed, payload),
        }
    }

    fn decode_charged(
        format: &Format,
        codec: Codec,
        how: Payload,
        item: &Bytes,
        payload: &[u8],
    ) -> Result<(Self, usize)> {
        match how {
            Payload::Raw => Self::decode_payload(format, codec, how, item, payload).map(|v| (v, 0)),
            how => format.decode_charged(codec, how == Payload::Compressed, payload),
        }
    }
}

fn encode_error(e: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::with_source(ErrorKind::Encode, "cannot serialize the value", e)
}

impl Format {
    /// Appends the encoded (and, above the threshold, compressed) `value` to `out`; returns
    /// whether the appended payload is compressed.
    pub(crate) fn encode_into<T: Serialize + ?Sized>(
        &self,
        value: &T,
        out: &mut Vec<u8>,
    ) -> Result<bool> {
        // Before any byte is written: a value its own type could not decode under the limit is
        // refused, however small it encodes (zeros compress to nothing and decode to 8 bytes
        // each).
        match charge::walk(value, self.max_decode, self.codec == Codec::MessagePack) {
            charge::Walk::Fits => {}
            charge::Walk::Over => {
                return Err(Error::new(
                    ErrorKind::TooLarge,
                    format!(
                        "decoding this value would allocate more than the decode limit of {} \
                         bytes (CacheBuilder::max_decode_size): it could never be read back",
                        self.max_decode
                    ),
                ));
            }
            charge::Walk::TooDeep => {
                return Err(Error::new(
                    ErrorKind::Encode,
                    format!(
                        "the value nests deeper than {} levels, more than a read decodes: it \
                         could never be read back",
                        bounded::MAX_DEPTH
                    ),
                ));
            }
        }
        let start = out.len();
        match self.codec {
            Codec::Bincode => {
                bincode::serde::encode_into_std_write(value, out, bincode::config::standard())
                    .map_err(encode_error)?;
            }
            Codec::MessagePack => {
                let mut ser = rmp_serde::Serializer::new(&mut *out)
                    .with_struct_map()
                    .with_bytes(rmp_serde::config::BytesMode::ForceIterables);
                value.serialize(&mut ser).map_err(encode_error)?;
            }
        }
        let plain = &out[start..];
        if plain.len() > self.max_decode {
            // Compressed, it might fit an item, and then no read could decode it.
            return Err(Error::new(
                ErrorKind::TooLarge,
                format!(
                    "the encoded value is {} bytes, above the decode limit of {} \
                     (CacheBuilder::max_decode_size): it could never be read back",
                    plain.len(),
                    self.max_decode
                ),
            ));
        }
        let Compression::Lz4 { min_size } = self.compression else {
            return Ok(false);
        };
        if plain.len() < min_size.max(1) || plain.len() > u32::MAX as usize {
            return Ok(false);
        }
        let packed = lz4_flex::block::compress(plain);
        if packed.len() + 4 >= plain.len() {
            return Ok(false);
        }
        let len = plain.len() as u32;
        out.truncate(start);
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&packed);
        Ok(true)
    }

    /// Decodes a whole payload written by `codec` (compressed or not), allocating at most
    /// `max_decode` bytes; trailing bytes are an error (they mean another type or corruption).
    pub(crate) fn decode<T: DeserializeOwned>(
        &self,
        codec: Codec,
        compressed: bool,
        payload: &[u8],
    ) -> Result<T> {
        self.decode_charged(codec, compressed, payload)
            .map(|(v, _)| v)
    }

    /// [`decode`](Format::decode), and what the value allocated (the bounded decoder's count,
    /// with the value's own size).
    pub(crate) fn decode_charged<T: DeserializeOwned>(
        &self,
        codec: Codec,
        compressed: bool,
        payload: &[u8],
    ) -> Result<(T, usize)> {
        if compressed {
            let plain = self.decompress(payload)?;
            return self.decode_plain(codec, &plain);
        }
        self.decode_plain(codec, payload)
    }

    pub(crate) fn decompress(&self, payload: &[u8]) -> Result<Vec<u8>> {
        let Some((len, packed)) = payload.split_first_chunk::<4>() else {
            return Err(Error::decode("truncated compressed payload"));
        };
        let len = u32::from_le_bytes(*len) as usize;
        if len > self.max_decode {
            return Err(Error::decode(format!(
                "the compressed value claims {len} bytes, above the decode limit of {} \
                 (CacheBuilder::max_decode_size)",
                self.max_decode
            )));
        }
        lz4_flex::block::decompress(packed, len).map_err(|e| {
            Error::with_source(ErrorKind::Decode, "cannot decompress the stored value", e)
        })
    }

    fn decode_plain<T: DeserializeOwned>(
        &self,
        codec: Codec,
        payload: &[u8],
    ) -> Result<(T, usize)> {
        let budget = bounded::Budget::new(self.max_decode);
        let charged = |b: &bounded::Budget| self.max_decode - b.left();
        let failed = |e: &dyn std::fmt::Display, name: &str| {
            Error::decode(format!(
                "the stored value is not a `{}` ({name}: {e})",
                std::any::type_name::<T>()
            ))
        };
        match codec {
            Codec::Bincode => {
                let (value, used) = bincode::serde::seed_decode_from_slice(
                    bounded::seed::<T>(&budget),
                    payload,
                    bincode::config::standard(),
                )
                .map_err(|e| failed(&e, "bincode"))?;
                if used != payload.len() {
                    return Err(trailing::<T>(payload.len() - used));
                }
                Ok((value, charged(&budget)))
            }
            Codec::MessagePack => {
                let mut de = rmp_serde::Deserializer::from_read_ref(payload);
                let value = bounded::seed::<T>(&budget)
                    .deserialize(&mut de)
                    .map_err(|e| failed(&e, "MessagePack"))?;
                // rmp-serde does not say how much it read; measure the value instead.
                match msgpack::value_len(payload) {
                    Some(n) if n == payload.len() => Ok((value, charged(&budget))),
                    Some(n) => Err(trailing::<T>(payload.len() - n)),
                    None => Err(failed(&"truncated", "MessagePack")),
                }
            }
        }
    }
}

fn trailing<T>(n: usize) -> Error {
    Error::decode(format!(
        "the stored value is not a `{}`: {n} trailing bytes",
        std::any::type_name::<T>()
    ))
}
#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct User {
        id: u64,
        name: String,
        tags: Vec<String>,
    }

    fn format(codec: Codec) -> Format {
        Format {
            codec,
            ..Format::default()
        }
    }

    fn encode<T: Serialize>(f: &Format, v: &T) -> Vec<u8> {
        let mut buf = Vec::new();
        assert!(!f.encode_into(v, &mut buf).unwrap() || f.compression != Compression::Off);
        buf
    }

    const BOTH: [Codec; 2] = [Codec::MessagePack, Codec::Bincode];

    #[test]
    fn round_trip() {
        let u = User {
            id: 42,
            name: "ann".into(),
            tags: vec!["a".into()],
        };
        for c in BOTH {
            let f = format(c);
            assert_eq!(f.decode::<User>(c, false, &encode(&f, &u)).unwrap(), u);
        }
    }

    #[test]
    fn values_larger_in_memory_than_the_item_size_round_trip() {
        // 140,000 u64s: 1.1 MB in memory, well under the item size encoded. A limit on
        // in-memory bytes would store such a value and then fail every read of it.
        let numbers: Vec<u64> = (0..140_000u64).map(|i| i * 7919).collect();
        let strings: Vec<String> = (0..60_000).map(|i| format!("s{i}")).collect();
        for c in BOTH {
            let f = format(c);
            let bytes = encode(&f, &numbers);
            assert!(bytes.len() < crate::backend::DEFAULT_ITEM_SIZE, "{c:?}");
            assert_eq!(f.decode::<Vec<u64>>(c, false, &bytes).unwrap(), numbers);
            let bytes = encode(&f, &strings);
            assert_eq!(f.decode::<Vec<String>>(c, false, &bytes).unwrap(), strings);
        }
    }

    #[test]
    fn decoding_is_bounded_by_the_limit() {
        let numbers: Vec<u64> = (0..10_000u64).collect();
        for c in BOTH {
            let f = Format {
                max_decode: 40_000, // 10,000 u64s need 80,000 bytes
                ..format(c)
            };
            // written by a build with a larger limit
            let e = f
                .decode::<Vec<u64>>(c, false, &encode(&format(c), &numbers))
                .unwrap_err();
            assert!(
                e.is_decode() && e.to_string().contains("decode limit"),
                "{e}"
            );
            // this build refuses to write it
            let e = f.encode_into(&numbers, &mut Vec::new()).unwrap_err();
            assert!(e.is_too_large() && e.to_string().contains("40000"), "{e}");
        }
    }

    #[test]
    fn huge_length_prefixes_are_refused_without_allocating() {
        let f = format(Codec::Bincode);
        // A Vec<u8> / String whose varint length claims 2^60 bytes.
        let mut bytes = vec![0xfd];
        bytes.extend_from_slice(&(1u64 << 60).to_le_bytes());
        assert!(
            f.decode::<Vec<u8>>(Codec::Bincode, false, &bytes)
                .unwrap_err()
                .is_decode()
        );
        assert!(
            f.decode::<String>(Codec::Bincode, false, &bytes)
                .unwrap_err()
                .is_decode()
        );
        assert!(
            f.decode::<Vec<u64>>(Codec::Bincode, false, &bytes)
                .unwrap_err()
                .is_decode()
        );
        // MessagePack: array32 / str32 / bin32 claiming 4 G entries.
        for marker in [0xdd, 0xdb, 0xc6] {
            let bytes = [marker, 0xff, 0xff, 0xff, 0xff, 0x01];
            let m = Codec::MessagePack;
            assert!(f.decode::<Vec<u64>>(m, false, &bytes).is_err());
            assert!(f.decode::<String>(m, false, &bytes).is_err());
            assert!(f.decode::<Vec<u8>>(m, false, &bytes).is_err());
        }
        // A compressed payload claiming 4 GiB once decompressed.
        let mut bytes = u32::MAX.to_le_bytes().to_vec();
        bytes.extend_from_slice(&[0x10, b'x']);
        let e = f
            .decode::<String>(Codec::Bincode, true, &bytes)
            .unwrap_err();
        assert!(
            e.is_decode() && e.to_string().contains("decode limit"),
            "{e}"
        );
    }

    #[test]
    fn deep_nesting_is_refused() {
        // 100,000 nested one-element arrays: a recursive type would overflow the stack.
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Tree(Vec<Tree>);
        let mut bytes = vec![0x91; 100_000];
        bytes.push(0x90);
        let e = format(Codec::MessagePack)
            .decode::<Tree>(Codec::MessagePack, false, &bytes)
            .unwrap_err();
        assert!(e.is_decode(), "{e}");
    }

    #[test]
    fn message_pack_tolerates_added_and_removed_fields() {
        #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
        struct Old {
            id: u64,
            name: String,
        }
        #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
        struct New {
            id: u64,
            name: String,
            #[serde(default)]
            email: Option<String>,
        }
        let m = format(Codec::MessagePack);
        let old = Old {
            id: 1,
            name: "ann".into(),
        };
        let new = New {
            id: 2,
            name: "bob".into(),
            email: Some("b@x".into()),
        };
        let read_new = m.decode::<New>(Codec::MessagePack, false, &encode(&m, &old));
        assert_eq!(read_new.unwrap().email, None);
        let read_old = m.decode::<Old>(Codec::MessagePack, false, &encode(&m, &new));
        assert_eq!(read_old.unwrap().name, "bob");
        // bincode is positional: the same change is a decode error (bump the version).
        let b = format(Codec::Bincode);
        assert!(
            b.decode::<New>(Codec::Bincode, false, &encode(&b, &old))
                .is_err()
        );
    }

    #[test]
    fn byte_payloads_are_message_pack_binary() {
        let m = format(Codec::MessagePack);
        let bytes = encode(&m, &vec![0xffu8; 300]);
        assert_eq!(bytes[0], 0xc5, "bin16, not an array of integers");
        assert_eq!(bytes.len(), 3 + 300);
        let back: Vec<u8> = m.decode(Codec::MessagePack, false, &bytes).unwrap();
        assert_eq!(back, vec![0xffu8; 300]);
        #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
        struct Blob {
            data: Vec<u8>,
        }
        let bytes = encode(&m, &bytes::Bytes::from_static(&[9; 40]));
        assert_eq!(&bytes[..2], &[0xc4, 40], "bytes::Bytes is bin8 too");
        let back: bytes::Bytes = m.decode(Codec::MessagePack, false, &bytes).unwrap();
        assert_eq!(&back[..], &[9; 40]);
        let blob = Blob {
            data: vec![1, 2, 3],
        };
        let bytes = encode(&m, &blob);
        assert_eq!(&bytes[bytes.len() - 5..], &[0xc4, 3, 1, 2, 3]);
        assert_eq!(
            m.decode::<Blob>(Codec::MessagePack, false, &bytes).unwrap(),
            blob
        );
    }

    #[test]
    fn compression_is_opt_in_marked_and_bounded() {
        let page = "<tr><td class=\"name\">row</td><td>42</td></tr>\n".repeat(450);
        assert!(page.len() > 20_000);
        let f = Format {
            compression: Compression::Lz4 { min_size: 1024 },
            ..Format::default()
        };
        let mut buf = Vec::new();
        assert!(f.encode_into(&page, &mut buf).unwrap());
        assert!(
            buf.len() * 5 < page.len(),
            "{} -> {}",
            page.len(),
            buf.len()
        );
        let back: String = Format::default()
            .decode(Codec::MessagePack, true, &buf)
            .unwrap();
        assert_eq!(back, page);
        // below the threshold, or when it would not shrink: stored as is
        let mut small = Vec::new();
        assert!(!f.encode_into(&"short", &mut small).unwrap());
        let mut plain = Vec::new();
        assert!(!Format::default().encode_into(&page, &mut plain).unwrap());
    }

    #[test]
    fn what_could_never_be_read_back_is_not_stored() {
        // 1 MB of text compresses into a few KB; with a 100 KB decode limit no read could
        // inflate it, so the write is refused instead.
        let f = Format {
            compression: Compression::Lz4 { min_size: 1024 },
            max_decode: 100_000,
            ..Format::default()
        };
        let e = f
            .encode_into(&"x".repeat(1 << 20), &mut Vec::new())
            .unwrap_err();
        assert!(
            e.is_too_large() && e.to_string().contains("decode limit"),
            "{e}"
        );
    }

    #[test]
    fn wrong_type_or_trailing_bytes() {
        for c in BOTH {
            let f = format(c);
            let buf = encode(&f, &(1u8, 2u8));
            assert!(f.decode::<u8>(c, false, &buf).unwrap_err().is_decode());
            assert!(f.decode::<String>(c, false, &[]).unwrap_err().is_decode());
        }
    }

    #[test]
    fn buffered_serde_shapes_with_byte_fields_round_trip() {
        // serde buffers these through deserialize_any, where MessagePack's `bin` arrives as
        // bytes; the adapter replays it as a sequence so that `Vec<u8>` fields still read.
        #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
        #[serde(tag = "type")]
        enum Tagged {
            Blob { data: Vec<u8> },
            Text { text: String },
        }
        #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
        #[serde(untagged)]
        enum Untagged {
            Blob { data: Vec<u8>, id: u32 },
            Name(String),
        }
        #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
        struct Inner {
            data: Vec<u8>,
            #[serde(with = "serde_bytes_like")]
            raw: Vec<u8>,
        }
        #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
        struct Outer {
            id: u64,
            #[serde(flatten)]
            inner: Inner,
        }
        mod serde_bytes_like {
            pub fn serialize<S: serde::Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(v)
            }
            pub fn deserialize<'de, D: serde::Deserializer<'de>>(
                d: D,
            ) -> Result<Vec<u8>, D::Error> {
                bytes::Bytes::deserialize(d).map(|b| b.to_vec())
            }
            use serde::Deserialize;
        }
        let m = format(Codec::MessagePack);
        let c = Codec::MessagePack;
        for v in [
            Tagged::Blob {
                data: vec![1, 2, 3],
            },
            Tagged::Text { text: "t".into() },
        ] {
            assert_eq!(m.decode::<Tagged>(c, false, &encode(&m, &v)).unwrap(), v);
        }
        for v in [
            Untagged::Blob {
                data: vec![9; 40],
                id: 7,
            },
            Untagged::Name("n".into()),
        ] {
            assert_eq!(m.decode::<Untagged>(c, false, &encode(&m, &v)).unwrap(), v);
        }
        let v = Outer {
            id: 1,
            inner: Inner {
                data: vec![4, 5],
                raw: vec![6; 10],
            },
        };
        assert_eq!(m.decode::<Outer>(c, false, &encode(&m, &v)).unwrap(), v);
    }

    #[test]
    fn recursion_without_input_is_bounded() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Link(Option<Box<Link>>);
        // MessagePack: rmp-serde keeps a non-nil marker peeked and recurses without consuming.
        let e = format(Codec::MessagePack)
            .decode::<Link>(Codec::MessagePack, false, &[0x01])
            .unwrap_err();
        assert!(e.to_string().contains("nests deeper"), "{e}");
        // bincode: a million `Some`s.
        let mut bytes = vec![1u8; 1_000_000];
        bytes.push(0);
        let e = format(Codec::Bincode)
            .decode::<Link>(Codec::Bincode, false, &bytes)
            .unwrap_err();
        assert!(e.to_string().contains("nests deeper"), "{e}");
    }

    #[test]
    fn zero_sized_elements_cannot_spin() {
        // A Vec<()> claiming 2^40 elements in 9 bytes: each element is charged a byte.
        let mut bytes = vec![0xfd];
        bytes.extend_from_slice(&(1u64 << 40).to_le_bytes());
        let e = format(Codec::Bincode)
            .decode::<Vec<()>>(Codec::Bincode, false, &bytes)
            .unwrap_err();
        assert!(e.to_string().contains("decode limit"), "{e}");
    }

    #[test]
    fn owned_string_visitors_still_get_owned_strings() {
        // A visitor that implements only visit_string (not visit_str).
        #[derive(Debug, PartialEq)]
        struct OnlyOwned(String);
        impl<'de> serde::Deserialize<'de> for OnlyOwned {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                #[allow(clippy::serde_api_misuse)] // such visitors exist: the point of the test
                impl serde::de::Visitor<'_> for V {
                    type Value = OnlyOwned;
                    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                        f.write_str("a string")
                    }
                    fn visit_string<E>(self, v: String) -> Result<OnlyOwned, E> {
                        Ok(OnlyOwned(v))
                    }
                }
                d.deserialize_string(V)
            }
        }
        for c in BOTH {
            let f = format(c);
            let got = f
                .decode::<OnlyOwned>(c, false, &encode(&f, &"owned"))
                .unwrap();
            assert_eq!(got, OnlyOwned("owned".into()));
        }
    }
}
