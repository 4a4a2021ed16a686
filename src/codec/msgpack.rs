//! The length of one MessagePack value, without decoding it: how the codec finds trailing bytes
//! (`rmp-serde`'s borrowing reader does not say how much it consumed).

/// The byte length of the first MessagePack value in `bytes`; `None` if it is truncated or uses
/// a reserved marker. Iterative, so any nesting depth is safe.
pub(crate) fn value_len(bytes: &[u8]) -> Option<usize> {
    let mut at = 0usize;
    // Values still to skip, including the nested ones announced by array and map headers.
    let mut pending: u64 = 1;
    let be = |at: usize, n: usize| -> Option<u64> {
        let s = bytes.get(at..at.checked_add(n)?)?;
        Some(s.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    };
    while pending > 0 {
        pending -= 1;
        let m = *bytes.get(at)?;
        at += 1;
        // (payload bytes to skip, values announced)
        let (skip, nested): (u64, u64) = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (0, 2 * u64::from(m & 0x0f)),
            0x90..=0x9f => (0, u64::from(m & 0x0f)),
            0xa0..=0xbf => (u64::from(m & 0x1f), 0),
            0xcc | 0xd0 => (1, 0),
            0xcd | 0xd1 => (2, 0),
            0xca | 0xce | 0xd2 => (4, 0),
            0xcb | 0xcf | 0xd3 => (8, 0),
            0xd4 => (2, 0),
            0xd5 => (3, 0),
            0xd6 => (5, 0),
            0xd7 => (9, 0),
            0xd8 => (17, 0),
            0xc4 | 0xd9 => (1 + be(at, 1)?, 0),
            0xc5 | 0xda => (2 + be(at, 2)?, 0),
            0xc6 | 0xdb => (4 + be(at, 4)?, 0),
            0xc7 => (1 + 1 + be(at, 1)?, 0),
            0xc8 => (2 + 1 + be(at, 2)?, 0),
            0xc9 => (4 + 1 + be(at, 4)?, 0),
            0xdc => (2, be(at, 2)?),
            0xdd => (4, be(at, 4)?),
            0xde => (2, 2 * be(at, 2)?),
            0xdf => (4, 2 * be(at, 4)?),
            0xc1 => return None,
        };
        // Most values (a fixint, a key's fixstr) skip bytes or announce values, not both, and
        // a scalar does neither: each check only where it can fail.
        if skip > 0 {
            at = at.checked_add(usize::try_from(skip).ok()?)?;
            if at > bytes.len() {
                return None;
            }
        }
        if nested > 0 {
            pending = pending.checked_add(nested)?;
            // Every pending value needs at least one byte: a count beyond the input is
            // truncated.
            if pending > (bytes.len() - at) as u64 {
                return None;
            }
        }
    }
    Some(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures_values() {
        assert_eq!(value_len(&[0x01, 0xff]), Some(1));
        assert_eq!(value_len(&[0x92, 0x01, 0xa1, b'x', 0x00]), Some(4));
        assert_eq!(value_len(&[0x81, 0xa1, b'k', 0xc0]), Some(4));
        assert_eq!(value_len(&[0xc4, 2, 9, 9, 7]), Some(4));
        assert_eq!(value_len(&[0xdd, 0xff, 0xff, 0xff, 0xff, 1]), None);
        assert_eq!(value_len(&[0xc6, 0xff, 0xff, 0xff, 0xff]), None);
        assert_eq!(value_len(&[0x92, 0x01]), None);
        assert_eq!(value_len(&[]), None);
        assert_eq!(value_len(&[0xc1]), None);
    }
}
