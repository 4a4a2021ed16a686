//! Value serialization: serde through bincode 2 (standard configuration), always decoded with a size
//! limit so that hostile bytes cannot make it allocate more than an item can hold. Pure.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, ErrorKind, Result};

/// The largest allocation a decode may make: memcached's default item size (1 MiB).
pub(crate) const DECODE_LIMIT: usize = 1 << 20;

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<DECODE_LIMIT>()
}

/// Appends the bincode form of `value` to `out`.
pub(crate) fn encode_into<T: Serialize + ?Sized>(value: &T, out: &mut Vec<u8>) -> Result<()> {
    bincode::serde::encode_into_std_write(value, out, bincode::config::standard())
        .map(|_| ())
        .map_err(|e| Error::with_source(ErrorKind::Encode, "cannot serialize the value", e))
}

/// Decodes a whole payload; trailing bytes are an error (they mean another type or corruption).
pub(crate) fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T> {
    let (value, used) =
        bincode::serde::decode_from_slice::<T, _>(payload, config()).map_err(|e| {
            Error::with_source(
                ErrorKind::Decode,
                format!(
                    "the stored value is not a `{}` (bincode)",
                    std::any::type_name::<T>()
                ),
                e,
            )
        })?;
    if used != payload.len() {
        return Err(Error::decode(format!(
            "the stored value is not a `{}`: {} trailing bytes",
            std::any::type_name::<T>(),
            payload.len() - used
        )));
    }
    Ok(value)
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

    #[test]
    fn round_trip() {
        let u = User {
            id: 42,
            name: "ann".into(),
            tags: vec!["a".into()],
        };
        let mut buf = Vec::new();
        encode_into(&u, &mut buf).unwrap();
        assert_eq!(decode::<User>(&buf).unwrap(), u);
    }

    #[test]
    fn huge_length_prefix_is_refused_without_allocating() {
        // A Vec<u8> whose varint length claims 2^60 bytes.
        let mut bytes = vec![0xfd];
        bytes.extend_from_slice(&(1u64 << 60).to_le_bytes());
        let e = decode::<Vec<u8>>(&bytes).unwrap_err();
        assert!(e.is_decode(), "{e}");
        let e = decode::<String>(&[0xfc, 0xff, 0xff, 0xff, 0x7f]).unwrap_err();
        assert!(e.is_decode());
    }

    #[test]
    fn wrong_type_or_trailing_bytes() {
        let mut buf = Vec::new();
        encode_into(&(1u8, 2u8), &mut buf).unwrap();
        assert!(decode::<u8>(&buf).unwrap_err().is_decode());
        assert!(decode::<String>(&[]).unwrap_err().is_decode());
    }
}
