//! A serde `Deserializer` adapter that bounds what decoding may allocate, whatever the format.
//!
//! Every value a visitor builds is charged its in-memory size (`size_of` of the value, plus the
//! length of each string and byte string it receives) against one budget; sequence and map size
//! hints are capped by what is left, so a `Vec`'s preallocation stays within the budget too; and
//! nesting is capped at [`MAX_DEPTH`]. Owned strings and byte buffers are requested as borrowed
//! ones, so that a format (bincode) never allocates a length prefix's worth of bytes before the
//! bytes are known to be there: the payload is a slice, and a hostile length fails on reading.

use std::cell::Cell;
use std::fmt;

use serde::de::{
    self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor,
};

/// Deepest nesting decoded (recursive types cannot exhaust the stack).
pub(crate) const MAX_DEPTH: usize = 256;

/// What is left to allocate, shared by every adapter of one decode.
#[derive(Debug)]
pub(crate) struct Budget {
    left: Cell<usize>,
}

impl Budget {
    pub(crate) fn new(limit: usize) -> Self {
        Budget {
            left: Cell::new(limit),
        }
    }

    /// What is left of the budget.
    pub(crate) fn left(&self) -> usize {
        self.left.get()
    }

    /// Charges one value of type `T` (at least a byte, so that a sequence of zero-sized values
    /// cannot spin without end).
    fn charge_value<T, E: de::Error>(&self) -> Result<(), E> {
        self.charge(size_of::<T>().max(1))
    }

    fn charge<E: de::Error>(&self, n: usize) -> Result<(), E> {
        match self.left.get().checked_sub(n) {
            Some(left) => {
                self.left.set(left);
                Ok(())
            }
            None => Err(E::custom(format_args!(
                "decoding would allocate more than the decode limit \
                 (CacheBuilder::max_decode_size)"
            ))),
        }
    }

    /// A size hint capped at what the budget can hold of `T`s.
    fn cap<T>(&self, hint: Option<usize>) -> Option<usize> {
        let per = size_of::<T>().max(1);
        hint.map(|h| h.min(self.left.get() / per))
    }
}

/// A seed that deserializes a `T` within `budget`.
pub(crate) fn seed<T>(budget: &Budget) -> Seed<'_, std::marker::PhantomData<T>> {
    Seed {
        inner: std::marker::PhantomData,
        budget,
        depth: 0,
    }
}

/// A `DeserializeSeed` whose value, and everything in it, is charged to a [`Budget`].
pub(crate) struct Seed<'b, S> {
    inner: S,
    budget: &'b Budget,
    depth: usize,
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Seed<'_, S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<S::Value, D::Error> {
        let depth = deeper(self.depth)?;
        self.budget.charge_value::<S::Value, _>()?;
        self.inner.deserialize(Bounded {
            inner: d,
            budget: self.budget,
            depth,
        })
    }
}

/// One level deeper, or an error past [`MAX_DEPTH`]. Every path that can recurse (a seed, an
/// `Option`, a newtype) goes through it, so no input can exhaust the stack, including a format
/// that recurses without consuming input (rmp-serde on `struct L(Option<Box<L>>)`).
fn deeper<E: de::Error>(depth: usize) -> Result<usize, E> {
    if depth >= MAX_DEPTH {
        return Err(E::custom(format_args!(
            "the value nests deeper than {MAX_DEPTH} levels"
        )));
    }
    Ok(depth + 1)
}

/// What a visitor was asked for, where it changes how bytes and strings are handed on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Asked {
    /// A specific type: hand values on as they come.
    Exact,
    /// `deserialize_any` (serde's buffering for untagged and internally tagged enums and
    /// `flatten`): a byte string becomes a sequence of `u8`, so that the buffered value replays
    /// into a `Vec<u8>` as well as into a byte buffer (MessagePack stores `Vec<u8>` as binary).
    Any,
    /// An owned string or byte buffer, read as a borrowed one (see the module docs): hand it on
    /// owned, as the visitor asked.
    Owned,
}

struct Bounded<'b, D> {
    inner: D,
    budget: &'b Budget,
    depth: usize,
}

impl<'b, D> Bounded<'b, D> {
    fn wrap<V>(&self, inner: V) -> Checked<'b, V> {
        self.wrap_as(inner, Asked::Exact)
    }

    fn wrap_as<V>(&self, inner: V, asked: Asked) -> Checked<'b, V> {
        Checked {
            inner,
            budget: self.budget,
            depth: self.depth,
            asked,
        }
    }
}

macro_rules! forward {
    ($($method:ident($($arg:ident: $ty:ty),*);)*) => {$(
        fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, D::Error> {
            let v = self.wrap(visitor);
            self.inner.$method($($arg,)* v)
        }
    )*};
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Bounded<'_, D> {
    type Error = D::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        let v = self.wrap_as(visitor, Asked::Any);
        self.inner.deserialize_any(v)
    }

    forward! {
        deserialize_bool();
        deserialize_i8();
        deserialize_i16();
        deserialize_i32();
        deserialize_i64();
        deserialize_i128();
        deserialize_u8();
        deserialize_u16();
        deserialize_u32();
        deserialize_u64();
        deserialize_u128();
        deserialize_f32();
        deserialize_f64();
        deserialize_char();
        deserialize_str();
        deserialize_bytes();
        deserialize_option();
        deserialize_unit();
        deserialize_unit_struct(name: &'static str);
        deserialize_newtype_struct(name: &'static str);
        deserialize_seq();
        deserialize_tuple(len: usize);
        deserialize_tuple_struct(name: &'static str, len: usize);
        deserialize_map();
        deserialize_struct(name: &'static str, fields: &'static [&'static str]);
        deserialize_enum(name: &'static str, variants: &'static [&'static str]);
        deserialize_identifier();
        deserialize_ignored_any();
    }

    // Borrowed, so that the format reads the bytes before anything is allocated for them; the
    // visitor copies what it keeps (and is charged for it).
    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        let v = self.wrap_as(visitor, Asked::Owned);
        self.inner.deserialize_str(v)
    }

    fn deserialize_byte_buf<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        let v = self.wrap_as(visitor, Asked::Owned);
        self.inner.deserialize_bytes(v)
    }

    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }
}

struct Checked<'b, V> {
    inner: V,
    budget: &'b Budget,
    depth: usize,
    asked: Asked,
}

impl<'de, V: Visitor<'de>> Checked<'_, V> {
    /// A byte string handed on as the sequence of its bytes (already charged).
    fn bytes_as_seq<E: de::Error>(self, v: &[u8]) -> Result<V::Value, E> {
        let seq = de::value::SeqDeserializer::<_, E>::new(v.iter().copied());
        self.inner.visit_seq(seq)
    }
}

impl<'b, V> Checked<'b, V> {
    fn access<A>(&self, inner: A) -> Access<'b, A> {
        Access {
            inner,
            budget: self.budget,
            depth: self.depth,
        }
    }
}

macro_rules! scalar {
    ($($method:ident($ty:ty);)*) => {$(
        fn $method<E: de::Error>(self, v: $ty) -> Result<V::Value, E> {
            self.inner.$method(v)
        }
    )*};
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Checked<'_, V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.expecting(f)
    }

    scalar! {
        visit_bool(bool);
        visit_i8(i8);
        visit_i16(i16);
        visit_i32(i32);
        visit_i64(i64);
        visit_i128(i128);
        visit_u8(u8);
        visit_u16(u16);
        visit_u32(u32);
        visit_u64(u64);
        visit_u128(u128);
        visit_f32(f32);
        visit_f64(f64);
        visit_char(char);
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<V::Value, E> {
        self.budget.charge(v.len())?;
        match self.asked {
            Asked::Owned => self.inner.visit_string(v.to_owned()),
            _ => self.inner.visit_str(v),
        }
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<V::Value, E> {
        self.budget.charge(v.len())?;
        match self.asked {
            Asked::Owned => self.inner.visit_string(v.to_owned()),
            _ => self.inner.visit_borrowed_str(v),
        }
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<V::Value, E> {
        self.budget.charge(v.len())?;
        self.inner.visit_string(v)
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<V::Value, E> {
        self.budget.charge(v.len())?;
        match self.asked {
            Asked::Any => self.bytes_as_seq(v),
            Asked::Owned => self.inner.visit_byte_buf(v.to_vec()),
            Asked::Exact => self.inner.visit_bytes(v),
        }
    }

    fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<V::Value, E> {
        self.budget.charge(v.len())?;
        match self.asked {
            Asked::Any => self.bytes_as_seq(v),
            Asked::Owned => self.inner.visit_byte_buf(v.to_vec()),
            Asked::Exact => self.inner.visit_borrowed_bytes(v),
        }
    }

    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<V::Value, E> {
        self.budget.charge(v.len())?;
        match self.asked {
            Asked::Any => self.bytes_as_seq(&v),
            _ => self.inner.visit_byte_buf(v),
        }
    }

    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_none()
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        let (budget, depth) = (self.budget, deeper(self.depth)?);
        self.inner.visit_some(Bounded {
            inner: d,
            budget,
            depth,
        })
    }

    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_unit()
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        let (budget, depth) = (self.budget, deeper(self.depth)?);
        self.inner.visit_newtype_struct(Bounded {
            inner: d,
            budget,
            depth,
        })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        let a = self.access(seq);
        self.inner.visit_seq(a)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        let a = self.access(map);
        self.inner.visit_map(a)
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<V::Value, A::Error> {
        let a = self.access(data);
        self.inner.visit_enum(a)
    }
}

struct Access<'b, A> {
    inner: A,
    budget: &'b Budget,
    depth: usize,
}

impl<'b, A> Access<'b, A> {
    fn seed<S>(&self, inner: S) -> Seed<'b, S> {
        Seed {
            inner,
            budget: self.budget,
            depth: self.depth,
        }
    }
}

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for Access<'_, A> {
    type Error = A::Error;

    fn next_element_seed<S: DeserializeSeed<'de>>(
        &mut self,
        seed: S,
    ) -> Result<Option<S::Value>, A::Error> {
        let s = self.seed(seed);
        self.inner.next_element_seed(s)
    }

    fn size_hint(&self) -> Option<usize> {
        // Element types are unknown here; a hint of bytes is the safe reading.
        self.budget.cap::<u8>(self.inner.size_hint())
    }
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Access<'_, A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        let s = self.seed(seed);
        self.inner.next_key_seed(s)
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, A::Error> {
        let s = self.seed(seed);
        self.inner.next_value_seed(s)
    }

    fn size_hint(&self) -> Option<usize> {
        self.budget.cap::<u8>(self.inner.size_hint())
    }
}

impl<'b, 'de, A: EnumAccess<'de>> EnumAccess<'de> for Access<'b, A> {
    type Error = A::Error;
    type Variant = Access<'b, A::Variant>;

    fn variant_seed<S: DeserializeSeed<'de>>(
        self,
        seed: S,
    ) -> Result<(S::Value, Self::Variant), A::Error> {
        let s = self.seed(seed);
        let (budget, depth) = (self.budget, self.depth);
        let (value, variant) = self.inner.variant_seed(s)?;
        Ok((
            value,
            Access {
                inner: variant,
                budget,
                depth,
            },
        ))
    }
}

impl<'de, A: VariantAccess<'de>> VariantAccess<'de> for Access<'_, A> {
    type Error = A::Error;

    fn unit_variant(self) -> Result<(), A::Error> {
        self.inner.unit_variant()
    }

    fn newtype_variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<S::Value, A::Error> {
        let s = self.seed(seed);
        self.inner.newtype_variant_seed(s)
    }

    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, A::Error> {
        let v = Checked {
            inner: visitor,
            budget: self.budget,
            depth: self.depth,
            asked: Asked::Exact,
        };
        self.inner.tuple_variant(len, v)
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, A::Error> {
        let v = Checked {
            inner: visitor,
            budget: self.budget,
            depth: self.depth,
            asked: Asked::Exact,
        };
        self.inner.struct_variant(fields, v)
    }
}
