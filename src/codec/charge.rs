//! What decoding a value will allocate, counted from the value before it is encoded: the mirror
//! of `bounded.rs`, so that `set` refuses a value that its own type could not read back under
//! the decode limit (a compressed `vec![0u64; 9_000_000]` is 35 KB stored, 72 MB decoded).
//!
//! A serde `Serializer` that writes nothing and charges what the bounded decoder charges, at the
//! same points: every value a seed would decode (the whole value, each element of a sequence,
//! each key and value of a map, each field of a struct, each variant's identifier and newtype
//! payload) its `size_of` (at least 1), and each string and byte string its length. For owned
//! types (the usual cached value: `Vec<T>`, `String`, structs of them) the count is the decoder's
//! to the byte; a borrowed one (`&str` read back as a `String`) is counted at its own size.

use std::fmt;

use serde::ser::{self, Serialize};

/// Whether decoding `value` would allocate more than `limit` bytes (as `bounded.rs` counts),
/// for `codec`'s shape of a struct: MessagePack writes structs as maps (each field's name is
/// decoded too), bincode as tuples.
pub(crate) fn within<T: Serialize + ?Sized>(value: &T, limit: usize, struct_keys: bool) -> bool {
    Charge::new(limit, struct_keys).value(value).is_ok()
}

struct Charge {
    left: usize,
    struct_keys: bool,
    /// The value being walked was reached through a reference (serde hands a sequence's
    /// elements on as `&T`) or is unsized (`str`, a slice): its `size_of` is not the decoded
    /// type's, which its first serializer call then estimates by kind instead.
    unknown: bool,
    /// For each open struct or tuple: whether its own size is unknown, so that each member's
    /// size is charged once more (a struct's size is about the sum of its fields').
    compounds: Vec<bool>,
}

/// Past the limit (the walk stops there).
#[derive(Debug)]
struct Over;

impl fmt::Display for Over {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("over the decode limit")
    }
}

impl std::error::Error for Over {}

impl ser::Error for Over {
    fn custom<M: fmt::Display>(_: M) -> Self {
        Over
    }
}

/// A string's, a byte buffer's and a sequence's owner as decoded (`String`, `Vec<T>`).
const VEC: usize = size_of::<Vec<u8>>();
/// A map's owner as decoded (`HashMap`, the larger of std's two).
const MAP: usize = size_of::<std::collections::HashMap<u8, u8>>();

impl Charge {
    fn new(limit: usize, struct_keys: bool) -> Charge {
        Charge {
            left: limit,
            struct_keys,
            unknown: false,
            compounds: Vec::new(),
        }
    }

    fn charge(&mut self, n: usize) -> Result<(), Over> {
        self.left = self.left.checked_sub(n).ok_or(Over)?;
        Ok(())
    }

    /// A value a seed decodes: its own size (now, or by kind when it is unknown), then what it
    /// holds.
    fn value<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Over> {
        let name = std::any::type_name::<T>();
        if name.starts_with(['&', '[']) || name == "str" {
            self.unknown = true;
        } else {
            self.unknown = false;
            self.charge(size_of_val(v).max(1))?;
        }
        self.member(size_of_val(v))?;
        v.serialize(&mut *self)
    }

    /// A member of an open struct or tuple whose own size is unknown: charged once more, as
    /// part of that size.
    fn member(&mut self, n: usize) -> Result<(), Over> {
        if self.compounds.last() == Some(&true) {
            self.charge(n)?;
        }
        Ok(())
    }

    /// The size of a value whose `size_of` was unknown, estimated from its kind.
    fn own(&mut self, n: usize) -> Result<(), Over> {
        if std::mem::take(&mut self.unknown) {
            self.charge(n.max(1))?;
        }
        Ok(())
    }

    /// A struct or tuple opens: its size is the sum of its members' when it was unknown.
    fn open(&mut self) {
        let unknown = std::mem::take(&mut self.unknown);
        self.compounds.push(unknown);
    }

    fn close(&mut self) {
        self.compounds.pop();
    }

    /// A field name or variant identifier: serde's derived identifiers are a byte, and a
    /// MessagePack reader decodes the name's string too.
    fn identifier(&mut self, name: &str) -> Result<(), Over> {
        self.charge(1)?;
        if self.struct_keys {
            self.charge(name.len())?;
        }
        Ok(())
    }
}

macro_rules! primitive {
    ($($method:ident($ty:ty);)*) => {$(
        fn $method(self, _: $ty) -> Result<(), Over> {
            self.own(size_of::<$ty>())
        }
    )*};
}

impl ser::Serializer for &mut Charge {
    type Ok = ();
    type Error = Over;
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
    fn serialize_char(self, v: char) -> Result<(), Over> {
        self.own(size_of::<char>())?;
        self.charge(v.len_utf8())
    }
    fn serialize_str(self, v: &str) -> Result<(), Over> {
        self.own(VEC)?;
        self.charge(v.len())
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<(), Over> {
        self.own(VEC)?;
        self.charge(v.len())
    }
    fn serialize_none(self) -> Result<(), Over> {
        self.own(1)
    }
    // The decoder reads an `Option`'s and a newtype's content in place, without a seed.
    fn serialize_some<T: Serialize + ?Sized>(self, v: &T) -> Result<(), Over> {
        // An `Option` is its content and, unless the content has a niche, a tag padded to its
        // alignment (at most 8).
        let n = size_of_val(v);
        self.own(n + n.clamp(1, 8))?;
        v.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), Over> {
        self.own(1)
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), Over> {
        self.own(1)
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, v: &'static str) -> Result<(), Over> {
        self.own(1)?;
        self.identifier(v)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        v: &T,
    ) -> Result<(), Over> {
        self.own(size_of_val(v))?;
        v.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        v: &T,
    ) -> Result<(), Over> {
        self.own(size_of_val(v) + 8)?;
        self.identifier(variant)?;
        self.value(v)
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self, Over> {
        self.own(VEC)?;
        Ok(self)
    }
    fn serialize_tuple(self, _: usize) -> Result<Self, Over> {
        self.open();
        Ok(self)
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Self, Over> {
        self.open();
        Ok(self)
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Self, Over> {
        let unknown = std::mem::take(&mut self.unknown);
        self.identifier(variant)?;
        self.compounds.push(unknown);
        Ok(self)
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Self, Over> {
        self.own(MAP)?;
        Ok(self)
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self, Over> {
        self.open();
        Ok(self)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Self, Over> {
        let unknown = std::mem::take(&mut self.unknown);
        self.identifier(variant)?;
        self.compounds.push(unknown);
        Ok(self)
    }
    fn is_human_readable(&self) -> bool {
        // Neither codec is (serde types that serialize differently for humans, such as
        // addresses and times, take their compact form).
        false
    }
}

impl ser::SerializeSeq for &mut Charge {
    type Ok = ();
    type Error = Over;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Over> {
        // A sequence's elements are not members of an enclosing struct's size.
        self.compounds.push(false);
        let r = self.value(v);
        self.compounds.pop();
        r
    }
    fn end(self) -> Result<(), Over> {
        Ok(())
    }
}

impl ser::SerializeTuple for &mut Charge {
    type Ok = ();
    type Error = Over;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Over> {
        self.value(v)
    }
    fn end(self) -> Result<(), Over> {
        self.close();
        Ok(())
    }
}

impl ser::SerializeTupleStruct for &mut Charge {
    type Ok = ();
    type Error = Over;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Over> {
        self.value(v)
    }
    fn end(self) -> Result<(), Over> {
        self.close();
        Ok(())
    }
}

impl ser::SerializeTupleVariant for &mut Charge {
    type Ok = ();
    type Error = Over;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Over> {
        self.value(v)
    }
    fn end(self) -> Result<(), Over> {
        self.close();
        Ok(())
    }
}

impl ser::SerializeMap for &mut Charge {
    type Ok = ();
    type Error = Over;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, k: &T) -> Result<(), Over> {
        self.compounds.push(false);
        let r = self.value(k);
        self.compounds.pop();
        r
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Over> {
        self.compounds.push(false);
        let r = self.value(v);
        self.compounds.pop();
        r
    }
    fn end(self) -> Result<(), Over> {
        Ok(())
    }
}

impl ser::SerializeStruct for &mut Charge {
    type Ok = ();
    type Error = Over;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        v: &T,
    ) -> Result<(), Over> {
        if self.struct_keys {
            self.identifier(name)?;
        }
        self.value(v)
    }
    fn end(self) -> Result<(), Over> {
        self.close();
        Ok(())
    }
}

impl ser::SerializeStructVariant for &mut Charge {
    type Ok = ();
    type Error = Over;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        v: &T,
    ) -> Result<(), Over> {
        if self.struct_keys {
            self.identifier(name)?;
        }
        self.value(v)
    }
    fn end(self) -> Result<(), Over> {
        self.close();
        Ok(())
    }
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
        assert!(within(&zeros, (8 << 20) + 24, false));
        assert!(!within(&zeros, 8 << 20, false));
    }
}
