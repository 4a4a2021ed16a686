//! What decoding a value will allocate, counted from the value before it is encoded: the mirror
//! of `bounded.rs`, so that `set` refuses a value that its own type could not read back under
//! the decode limit (a compressed `vec![0u64; 9_000_000]` is 35 KB stored, 72 MB decoded).
//!
//! A serde `Serializer` that writes nothing and charges what the bounded decoder charges, at the
//! same points: every value a seed would decode (the whole value, each element of a sequence,
//! each key and value of a map, each field of a struct, each variant's identifier and newtype
//! payload) its `size_of` (at least 1), and each string and byte string its length; and it
//! refuses what nests deeper than the decoder goes.
//!
//! Exact where serde hands the walk the value's own type: the whole value, struct fields,
//! tuple and array elements, `Some`'s content. A sequence's and a map's elements come as
//! references (`&T`), whose `size_of` is not the decoded type's: there each element's size is
//! estimated from what it serializes as (a `u64` 8, a string 24 and its bytes, a struct its
//! fields' sizes padded to the largest one's alignment, `Some(v)` `v`'s size and a tag below 24
//! bytes, `None` 24), and every element of one sequence is charged the largest estimate among
//! them, since they share one type. What stays estimated: an enum is charged its variant's
//! payload, so a sequence that holds only unit variants of an enum with data variants is
//! under-counted; serde's buffered shapes (untagged and internally tagged enums,
//! `#[serde(flatten)]`) decode each element through a 32-byte buffer the walk does not charge.

use std::fmt;

use serde::ser::{self, Serialize};

use super::bounded::MAX_DEPTH;

/// What the walk found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Walk {
    /// Decoding stays within the limit (or the value's `Serialize` failed: the encoder then
    /// reports that error itself).
    Fits,
    /// Decoding would allocate more than the limit.
    Over,
    /// The value nests deeper than the decoder's [`MAX_DEPTH`].
    TooDeep,
}

/// What decoding `value` would allocate against `limit` bytes (as `bounded.rs` counts), for
/// `codec`'s shape of a struct: MessagePack writes structs as maps (each field's name is
/// decoded too), bincode as tuples.
pub(crate) fn walk<T: Serialize + ?Sized>(value: &T, limit: usize, struct_keys: bool) -> Walk {
    match Charge::new(limit, struct_keys).value(value) {
        Ok(()) | Err(Stop::Failed) => Walk::Fits,
        Err(Stop::Over) => Walk::Over,
        Err(Stop::Deep) => Walk::TooDeep,
    }
}

/// A string's, a byte buffer's and a sequence's owner as decoded (`String`, `Vec<T>`).
const VEC: usize = size_of::<Vec<u8>>();
/// A map's owner as decoded (`HashMap`, the larger of std's two).
const MAP: usize = size_of::<std::collections::HashMap<u8, u8>>();
/// A `None` whose `Option`'s size nothing else tells: an `Option` of a pointer-sized or
/// two-word value, or of a `String` or `Vec`.
const NONE: usize = 24;

/// Why the walk stopped.
#[derive(Debug)]
enum Stop {
    Over,
    Deep,
    /// The value's own `Serialize` failed.
    Failed,
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stop::Over => "over the decode limit",
            Stop::Deep => "nested too deep",
            Stop::Failed => "the value's Serialize failed",
        })
    }
}

impl std::error::Error for Stop {}

impl ser::Error for Stop {
    fn custom<M: fmt::Display>(_: M) -> Self {
        Stop::Failed
    }
}

/// Sizes of elements that share one type, charged their largest when they end.
#[derive(Debug, Default)]
struct Same {
    n: usize,
    charged: usize,
    max: usize,
    /// `None`s, each charged 1 so far: they are their siblings' size, or [`NONE`].
    nones: usize,
}

impl Same {
    fn add(&mut self, size: usize) {
        self.n += 1;
        self.charged += size;
        self.max = self.max.max(size);
    }

    /// What is still owed for each element to be charged the largest size.
    fn owed(&self) -> usize {
        let none = if self.max > 0 { self.max } else { NONE };
        self.n.saturating_mul(self.max).saturating_sub(self.charged)
            + self.nones.saturating_mul(none - 1)
    }
}

/// An open value with members.
#[derive(Debug)]
enum Frame {
    /// A struct, tuple or variant. `own`: its own size was unknown (it was reached through a
    /// reference), and is its members' sizes padded to the largest one's alignment, charged
    /// when it closes.
    Compound { own: bool, sum: usize, align: usize },
    /// A sequence: its elements share one type.
    Seq(Same),
    /// A map: its keys share one type, and its values another. `value`: a key was just given.
    Map {
        keys: Same,
        values: Same,
        value: bool,
    },
}

struct Charge {
    left: usize,
    struct_keys: bool,
    depth: usize,
    /// The value being walked came through a reference (or is unsized: `str`, a slice), so its
    /// `size_of` is not the decoded type's: its first serializer call estimates it by kind.
    unknown: bool,
    frames: Vec<Frame>,
}

/// The alignment a value of `size` bytes likely has (a power of two, at most 8).
fn align_of_size(size: usize) -> usize {
    match size {
        0 | 1 => 1,
        2..=3 => 2,
        4..=7 => 4,
        _ => 8,
    }
}

/// The tag an `Option` or enum adds to a payload of `size` bytes: none for 24 bytes and more
/// (a `String`, a `Vec`: their niche holds it), else the payload's alignment.
fn tagged(size: usize) -> usize {
    if size >= 24 {
        size
    } else {
        size + align_of_size(size.max(1))
    }
}

impl Charge {
    fn new(limit: usize, struct_keys: bool) -> Charge {
        Charge {
            left: limit,
            struct_keys,
            depth: 0,
            unknown: false,
            frames: Vec::new(),
        }
    }

    fn charge(&mut self, n: usize) -> Result<(), Stop> {
        self.left = self.left.checked_sub(n).ok_or(Stop::Over)?;
        Ok(())
    }

    /// One level deeper for `f`, as the decoder goes one deeper for every seed, `Some` and
    /// newtype.
    fn deeper(&mut self, f: impl FnOnce(&mut Self) -> Result<(), Stop>) -> Result<(), Stop> {
        if self.depth >= MAX_DEPTH {
            return Err(Stop::Deep);
        }
        self.depth += 1;
        let r = f(self);
        self.depth -= 1;
        r
    }

    /// A value a seed decodes: its own size (now, or by kind when it is unknown), then what it
    /// holds.
    fn value<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Stop> {
        self.deeper(|c| {
            let name = std::any::type_name::<T>();
            if name.starts_with(['&', '[']) || name == "str" {
                c.unknown = true;
            } else {
                c.unknown = false;
                let size = size_of_val(v).max(1);
                c.charge(size)?;
                c.member(size);
            }
            v.serialize(&mut *c)
        })
    }

    /// Tells the open frame a member's size.
    fn member(&mut self, size: usize) {
        match self.frames.last_mut() {
            Some(Frame::Compound { sum, align, .. }) => {
                *sum += size;
                *align = (*align).max(align_of_size(size));
            }
            Some(Frame::Seq(same)) => same.add(size),
            Some(Frame::Map {
                keys,
                values,
                value,
            }) => {
                if *value {
                    values.add(size)
                } else {
                    keys.add(size)
                }
            }
            None => {}
        }
    }

    /// The size of a value whose `size_of` was unknown, estimated from its kind.
    fn own(&mut self, size: usize) -> Result<(), Stop> {
        if std::mem::take(&mut self.unknown) {
            let size = size.max(1);
            self.charge(size)?;
            self.member(size);
        }
        Ok(())
    }

    /// A struct, tuple or variant opens.
    fn open(&mut self) {
        let own = std::mem::take(&mut self.unknown);
        self.frames.push(Frame::Compound {
            own,
            sum: 0,
            align: 1,
        });
    }

    /// A sequence or map opens (its own size charged first).
    fn open_seq(&mut self, frame: Frame, size: usize) -> Result<(), Stop> {
        self.own(size)?;
        self.frames.push(frame);
        Ok(())
    }

    /// The open frame closes: what it still owes is charged.
    fn close(&mut self) -> Result<(), Stop> {
        match self.frames.pop() {
            Some(Frame::Compound {
                own: true,
                sum,
                align,
            }) => {
                let size = sum.div_ceil(align).saturating_mul(align).max(1);
                self.charge(size)?;
                self.member(size);
            }
            Some(Frame::Seq(same)) => self.charge(same.owed())?,
            Some(Frame::Map { keys, values, .. }) => {
                self.charge(keys.owed())?;
                self.charge(values.owed())?;
            }
            Some(Frame::Compound { .. }) | None => {}
        }
        Ok(())
    }

    /// A map's key or value is next.
    fn map_next(&mut self, is_value: bool) {
        if let Some(Frame::Map { value, .. }) = self.frames.last_mut() {
            *value = is_value;
        }
    }

    /// A field name or variant identifier: serde's derived identifiers are a byte, and a
    /// MessagePack reader decodes the name's string too.
    fn identifier(&mut self, name: &str) -> Result<(), Stop> {
        self.charge(1)?;
        if self.struct_keys {
            self.charge(name.len())?;
        }
        Ok(())
    }
}

macro_rules! primitive {
    ($($method:ident($ty:ty);)*) => {$(
        fn $method(self, _: $ty) -> Result<(), Stop> {
            self.own(size_of::<$ty>())
        }
    )*};
}

impl ser::Serializer for &mut Charge {
    type Ok = ();
    type Error = Stop;
    type SerializeSeq = Self;
    type SerializeTuple = Self;
    type SerializeTupleStruct = Self;
    type SerializeTupleVariant = Self;
    type SerializeMap = Self;
    type SerializeStruct = Self;
    type SerializeStructVariant = Self;

    primitive! {
        serialize_bool(bool);
        serialize_i8(i8);
        serialize_i16(i16);
        serialize_i32(i32);
        serialize_i64(i64);
        serialize_i128(i128);
        serialize_u8(u8);
        serialize_u16(u16);
        serialize_u32(u32);
        serialize_u64(u64);
        serialize_u128(u128);
        serialize_f32(f32);
        serialize_f64(f64);
    }
    // MessagePack writes a char as a string.
    fn serialize_char(self, v: char) -> Result<(), Stop> {
        self.own(size_of::<char>())?;
        self.charge(v.len_utf8())
    }
    fn serialize_str(self, v: &str) -> Result<(), Stop> {
        self.own(VEC)?;
        self.charge(v.len())
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<(), Stop> {
        self.own(VEC)?;
        self.charge(v.len())
    }
    fn serialize_none(self) -> Result<(), Stop> {
        if !std::mem::take(&mut self.unknown) {
            return Ok(());
        }
        // An element's `None`: its `Option` is its siblings' size (known when the sequence
        // closes), else a guess.
        self.charge(1)?;
        match self.frames.last_mut() {
            Some(Frame::Seq(same)) => same.nones += 1,
            Some(Frame::Map { values, .. }) => values.nones += 1,
            _ => {
                self.charge(NONE - 1)?;
                self.member(NONE);
            }
        }
        Ok(())
    }
    // The decoder reads an `Option`'s and a newtype's content in place, without a seed.
    fn serialize_some<T: Serialize + ?Sized>(self, v: &T) -> Result<(), Stop> {
        self.own(tagged(size_of_val(v)))?;
        self.deeper(|c| v.serialize(c))
    }
    fn serialize_unit(self) -> Result<(), Stop> {
        self.own(1)
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), Stop> {
        self.own(1)
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, v: &'static str) -> Result<(), Stop> {
        self.own(1)?;
        self.identifier(v)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        v: &T,
    ) -> Result<(), Stop> {
        self.own(size_of_val(v))?;
        self.deeper(|c| v.serialize(c))
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        v: &T,
    ) -> Result<(), Stop> {
        self.own(tagged(size_of_val(v)))?;
        self.identifier(variant)?;
        self.value(v)
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self, Stop> {
        self.open_seq(Frame::Seq(Same::default()), VEC)?;
        Ok(self)
    }
    fn serialize_tuple(self, _: usize) -> Result<Self, Stop> {
        self.open();
        Ok(self)
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Self, Stop> {
        self.open();
        Ok(self)
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Self, Stop> {
        self.open();
        self.identifier(variant)?;
        Ok(self)
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Self, Stop> {
        let frame = Frame::Map {
            keys: Same::default(),
            values: Same::default(),
            value: false,
        };
        self.open_seq(frame, MAP)?;
        Ok(self)
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self, Stop> {
        self.open();
        Ok(self)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Self, Stop> {
        self.open();
        self.identifier(variant)?;
        Ok(self)
    }
    fn is_human_readable(&self) -> bool {
        // Neither codec is (serde types that serialize differently for humans, such as
        // addresses and times, take their compact form).
        false
    }
}

macro_rules! members {
    ($($trait:ident :: $method:ident;)*) => {$(
        impl ser::$trait for &mut Charge {
            type Ok = ();
            type Error = Stop;
            fn $method<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Stop> {
                self.value(v)
            }
            fn end(self) -> Result<(), Stop> {
                self.close()
            }
        }
    )*};
}

members! {
    SerializeSeq::serialize_element;
    SerializeTuple::serialize_element;
    SerializeTupleStruct::serialize_field;
    SerializeTupleVariant::serialize_field;
}

impl ser::SerializeMap for &mut Charge {
    type Ok = ();
    type Error = Stop;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, k: &T) -> Result<(), Stop> {
        self.map_next(false);
        self.value(k)
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Stop> {
        self.map_next(true);
        self.value(v)
    }
    fn end(self) -> Result<(), Stop> {
        self.close()
    }
}

macro_rules! fields {
    ($($trait:ident;)*) => {$(
        impl ser::$trait for &mut Charge {
            type Ok = ();
            type Error = Stop;
            fn serialize_field<T: Serialize + ?Sized>(
                &mut self,
                name: &'static str,
                v: &T,
            ) -> Result<(), Stop> {
                if self.struct_keys {
                    self.identifier(name)?;
                }
                self.value(v)
            }
            fn end(self) -> Result<(), Stop> {
                self.close()
            }
        }
    )*};
}

fields! {
    SerializeStruct;
    SerializeStructVariant;
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};

    use serde::{Deserialize, Serialize, de::DeserializeOwned};

    use super::*;
    use crate::codec::{Codec, Format};

    /// What the walk charges for `v`.
    fn charged<T: Serialize>(v: &T, struct_keys: bool) -> usize {
        let mut c = Charge::new(usize::MAX, struct_keys);
        c.value(v).unwrap();
        assert!(c.frames.is_empty());
        usize::MAX - c.left
    }

    /// The smallest decode limit under which `v`, encoded by `codec`, decodes (a binary search).
    fn needed<T: Serialize + DeserializeOwned>(v: &T, codec: Codec) -> usize {
        let mut bytes = Vec::new();
        let wide = Format {
            codec,
            max_decode: usize::MAX / 2,
            ..Format::default()
        };
        wide.encode_into(v, &mut bytes).unwrap();
        let decodes = |limit| {
            let f = Format {
                max_decode: limit,
                ..wide
            };
            f.decode::<T>(codec, false, &bytes).is_ok()
        };
        let (mut refused, mut ok) = (0, 1 << 30);
        while ok - refused > 1 {
            let mid = (ok + refused) / 2;
            if decodes(mid) {
                ok = mid
            } else {
                refused = mid
            }
        }
        ok
    }

    /// The walk's count is the decoder's, to the byte.
    #[track_caller]
    fn check<T: Serialize + DeserializeOwned>(v: T) {
        for codec in [Codec::MessagePack, Codec::Bincode] {
            let keys = codec == Codec::MessagePack;
            assert_eq!(
                charged(&v, keys),
                needed(&v, codec),
                "{codec:?}: {}",
                std::any::type_name::<T>()
            );
        }
    }

    /// The walk's count estimates the decoder's within a factor of 2 (sizes reached through a
    /// reference, estimated by kind).
    #[track_caller]
    fn close<T: Serialize + DeserializeOwned>(v: T) {
        for codec in [Codec::MessagePack, Codec::Bincode] {
            let keys = codec == Codec::MessagePack;
            let (c, n) = (charged(&v, keys), needed(&v, codec));
            assert!(
                c <= n * 2 && n <= c * 2,
                "{codec:?}: {}: charged {c}, needed {n}",
                std::any::type_name::<T>()
            );
        }
    }

    #[derive(Serialize, Deserialize)]
    struct User {
        id: u64,
        name: String,
        tags: Vec<String>,
        manager: Option<Box<User>>,
        scores: BTreeMap<String, f64>,
    }

    #[derive(Serialize, Deserialize)]
    enum Shape {
        Dot,
        Circle(f64),
        Rect(u32, u32),
        Named { name: String, sides: u8 },
    }

    #[derive(Serialize, Deserialize)]
    struct Wrapper(Vec<u16>);

    #[test]
    fn the_walk_charges_what_decoding_allocates() {
        check(7u64);
        check("hello".to_string());
        check(vec![0u64; 1000]);
        check(vec!["a".to_string(), "bcd".to_string()]);
        check(vec![Some(1u8), Some(2)]);
        close(vec![Some(1u8), None]);
        close(vec![Some("s".to_string()), None]);
        check((1u8, "two".to_string(), [3u32; 4]));
        check(Wrapper(vec![1, 2, 3]));
        check(HashMap::from([
            ("k".to_string(), vec![1u8, 2]),
            ("l".to_string(), vec![]),
        ]));
        close(vec![
            Shape::Dot,
            Shape::Circle(1.0),
            Shape::Rect(1, 2),
            Shape::Named {
                name: "tri".into(),
                sides: 3,
            },
        ]);
        check(User {
            id: 1,
            name: "ann".into(),
            tags: vec!["admin".into()],
            manager: Some(Box::new(User {
                id: 2,
                name: "bob".into(),
                tags: vec![],
                manager: None,
                scores: BTreeMap::new(),
            })),
            scores: BTreeMap::from([("x".to_string(), 1.5)]),
        });
        check(serde_bytes_like());
        check(Shape::Named {
            name: "sq".into(),
            sides: 4,
        });
        check(vec![User {
            id: 3,
            name: "cy".into(),
            tags: vec!["a".into(), "b".into()],
            manager: None,
            scores: BTreeMap::new(),
        }]);
    }

    /// A byte buffer as serde sees one (`bytes::Bytes` serializes as bytes).
    fn serde_bytes_like() -> bytes::Bytes {
        bytes::Bytes::from_static(b"raw bytes")
    }

    #[test]
    fn a_value_over_the_limit_is_found_before_encoding() {
        let zeros = vec![0u64; 1 << 20];
        assert_eq!(walk(&zeros, (8 << 20) + 24, false), Walk::Fits);
        assert_eq!(walk(&zeros, 8 << 20, false), Walk::Over);
    }
}
