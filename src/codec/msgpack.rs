//! A strict, borrowing MessagePack reader for the few shapes the item header
//! uses (maps, arrays, strings, unsigned integers). The read path decodes an
//! item header on every `get_item`; a general decoder into owned Strings and
//! Vecs cost about a microsecond there, while this reader walks the bytes in
//! place and hands out `&str` into them.
//!
//! Input comes from shared memory another process wrote, so it is hostile:
//! every read is bounds-checked, every count is checked against the bytes
//! left before anything loops over it, and anything outside the subset below
//! is an error, never a panic. Nothing here allocates, errors included.
//!
//! Accepted (every width MessagePack defines for these types, minimal or
//! not, since Python's and other writers may pick another width than rmp's):
//! - unsigned integers: positive fixint, uint8/16/32/64;
//! - strings: fixstr, str8/16/32, valid UTF-8;
//! - arrays: fixarray, array16/32; maps: fixmap, map16/32.
//!
//! Rejected: nil, booleans, floats, negative fixint and the signed int
//! families (even for non-negative values: no writer of item headers emits
//! them), bin, ext, the reserved byte 0xc1.

/// Why the bytes are not the MessagePack the header needs. Static text, so
/// the error path does not allocate either; the caller adds context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Malformed {
    /// What was expected or wrong.
    pub what: &'static str,
    /// Byte offset in the buffer where it went wrong.
    pub at: usize,
}

pub(super) type Parsed<T> = std::result::Result<T, Malformed>;

/// A cursor over MessagePack bytes.
#[derive(Clone, Copy, Debug)]
pub(super) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    #[inline]
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// A reader over `buf` starting at `pos` (a position this module handed
    /// out earlier, so re-walking a validated region needs no copy).
    #[inline]
    pub(super) fn at(buf: &'a [u8], pos: usize) -> Self {
        Reader { buf, pos }
    }

    /// Bytes consumed so far.
    #[inline]
    pub(super) fn pos(&self) -> usize {
        self.pos
    }

    /// Bytes left.
    #[inline]
    pub(super) fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    #[inline]
    pub(super) fn err(&self, what: &'static str) -> Malformed {
        Malformed { what, at: self.pos }
    }

    #[inline]
    fn take(&mut self, n: usize) -> Parsed<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(self.err("truncated"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    #[inline]
    fn byte(&mut self) -> Parsed<u8> {
        Ok(self.take(1)?[0])
    }

    #[inline]
    fn be<const N: usize>(&mut self) -> Parsed<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    /// A big-endian length of 2 or 4 bytes, as a usize.
    #[inline]
    fn len16(&mut self) -> Parsed<usize> {
        Ok(u16::from_be_bytes(self.be()?) as usize)
    }

    #[inline]
    fn len32(&mut self) -> Parsed<usize> {
        usize::try_from(u32::from_be_bytes(self.be()?)).map_err(|_| self.err("length overflows"))
    }

    /// An unsigned integer of any MessagePack width.
    #[inline]
    pub(super) fn uint(&mut self) -> Parsed<u64> {
        let start = self.pos;
        let v = match self.byte()? {
            b @ 0x00..=0x7f => u64::from(b),
            0xcc => u64::from(self.byte()?),
            0xcd => u64::from(u16::from_be_bytes(self.be()?)),
            0xce => u64::from(u32::from_be_bytes(self.be()?)),
            0xcf => u64::from_be_bytes(self.be()?),
            _ => {
                return Err(Malformed {
                    what: "expected an unsigned integer",
                    at: start,
                })
            }
        };
        Ok(v)
    }

    /// A string's bytes, borrowed from the buffer, not checked as UTF-8:
    /// for comparing with known names, where a match proves it.
    #[inline]
    pub(super) fn raw_str(&mut self) -> Parsed<&'a [u8]> {
        let start = self.pos;
        let n = match self.byte()? {
            b @ 0xa0..=0xbf => usize::from(b & 0x1f),
            0xd9 => usize::from(self.byte()?),
            0xda => self.len16()?,
            0xdb => self.len32()?,
            _ => {
                return Err(Malformed {
                    what: "expected a string",
                    at: start,
                })
            }
        };
        self.take(n)
    }

    /// A UTF-8 string, borrowed from the buffer.
    #[inline]
    pub(super) fn str(&mut self) -> Parsed<&'a str> {
        let start = self.pos;
        std::str::from_utf8(self.raw_str()?).map_err(|_| Malformed {
            what: "string is not UTF-8",
            at: start,
        })
    }

    /// An array's element count. Every element takes at least one byte, so
    /// a count larger than the bytes left is rejected here, before a caller
    /// loops over it.
    #[inline]
    pub(super) fn array_len(&mut self) -> Parsed<usize> {
        let start = self.pos;
        let n = match self.byte()? {
            b @ 0x90..=0x9f => usize::from(b & 0x0f),
            0xdc => self.len16()?,
            0xdd => self.len32()?,
            _ => {
                return Err(Malformed {
                    what: "expected an array",
                    at: start,
                })
            }
        };
        if n > self.remaining() {
            return Err(Malformed {
                what: "array count exceeds the bytes left",
                at: start,
            });
        }
        Ok(n)
    }

    /// A map's entry count; each entry takes at least two bytes.
    #[inline]
    pub(super) fn map_len(&mut self) -> Parsed<usize> {
        let start = self.pos;
        let n = match self.byte()? {
            b @ 0x80..=0x8f => usize::from(b & 0x0f),
            0xde => self.len16()?,
            0xdf => self.len32()?,
            _ => {
                return Err(Malformed {
                    what: "expected a map",
                    at: start,
                })
            }
        };
        if n > self.remaining() / 2 {
            return Err(Malformed {
                what: "map count exceeds the bytes left",
                at: start,
            });
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_width_of_each_accepted_type_reads_back() {
        let ints: [(&[u8], u64); 6] = [
            (&[0x05], 5),
            (&[0x7f], 127),
            (&[0xcc, 0xff], 255),
            (&[0xcd, 0x01, 0x00], 256),
            (&[0xce, 0, 1, 0, 0], 65536),
            (
                &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
                u64::MAX,
            ),
        ];
        for (b, v) in ints {
            let mut r = Reader::new(b);
            assert_eq!(r.uint(), Ok(v));
            assert_eq!(r.remaining(), 0);
        }
        // Non-minimal width: a small number as uint64.
        assert_eq!(Reader::new(&[0xcf, 0, 0, 0, 0, 0, 0, 0, 7]).uint(), Ok(7));
        let strs: [&[u8]; 4] = [
            b"\xa2hi",
            b"\xd9\x02hi",
            b"\xda\x00\x02hi",
            b"\xdb\x00\x00\x00\x02hi",
        ];
        for b in strs {
            assert_eq!(Reader::new(b).str(), Ok("hi"));
        }
        for b in [
            &[0x92u8, 1, 2][..],
            &[0xdc, 0, 2, 1, 2],
            &[0xdd, 0, 0, 0, 2, 1, 2],
        ] {
            assert_eq!(Reader::new(b).array_len(), Ok(2));
        }
        for b in [
            &[0x81u8, 1, 2][..],
            &[0xde, 0, 1, 1, 2],
            &[0xdf, 0, 0, 0, 1, 1, 2],
        ] {
            assert_eq!(Reader::new(b).map_len(), Ok(1));
        }
    }

    #[test]
    fn other_types_counts_past_the_end_and_bad_utf8_are_rejected() {
        // Signed ints (even non-negative), nil, bool, float, bin, ext, 0xc1.
        for b in [
            0xd0u8, 0xd3, 0xff, 0xc0, 0xc2, 0xca, 0xcb, 0xc4, 0xc7, 0xd4, 0xc1,
        ] {
            let buf = [b, 0, 0, 0, 0, 0, 0, 0, 0];
            assert!(Reader::new(&buf).uint().is_err(), "{b:#x}");
            assert!(Reader::new(&buf).str().is_err(), "{b:#x}");
            assert!(Reader::new(&buf).array_len().is_err(), "{b:#x}");
            assert!(Reader::new(&buf).map_len().is_err(), "{b:#x}");
        }
        assert!(Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff])
            .array_len()
            .is_err());
        assert!(Reader::new(&[0xdf, 0xff, 0xff, 0xff, 0xff])
            .map_len()
            .is_err());
        assert!(Reader::new(&[0x82, 1, 2, 3]).map_len().is_err());
        assert!(Reader::new(&[0xdb, 0xff, 0xff, 0xff, 0xff, b'a'])
            .str()
            .is_err());
        assert!(Reader::new(b"\xa2\xff\xfe").str().is_err());
        assert!(Reader::new(&[0xcf, 0, 0]).uint().is_err());
        assert!(Reader::new(&[]).uint().is_err());
    }
}
