//! The borrowing header reader against rmp-serde (the writer, and the
//! decoder it replaces on the read path), other encoders' choices, and
//! hostile bytes.

use proptest::prelude::*;

use super::*;
use crate::codec::ItemLayout;

/// Object bytes: the item prefix, then `header`, zero-padded to `len`.
fn object(header: &[u8], len: usize) -> Vec<u8> {
    let mut o = vec![0u8; len.max(ITEM_PREFIX_LEN + header.len())];
    o[0..4].copy_from_slice(&ITEM_MAGIC.to_le_bytes());
    o[4..6].copy_from_slice(&CODEC_VERSION.to_le_bytes());
    o[8..12].copy_from_slice(&(header.len() as u32).to_le_bytes());
    o[ITEM_PREFIX_LEN..ITEM_PREFIX_LEN + header.len()].copy_from_slice(header);
    o
}

/// Decodes a header alone, without checking its fields against an object
/// (so offsets and lengths can be any u64).
fn decode(header: &[u8]) -> Result<ItemHeader> {
    let at = walk_header(header, |_| Ok(()))?;
    Ok(ItemView {
        object: &[],
        header,
        at,
    }
    .to_header())
}

fn is_corrupt<T: fmt::Debug>(r: &Result<T>) -> bool {
    matches!(r, Err(Error::CorruptObject(_)))
}

/// A MessagePack value, to write headers as other encoders might.
#[derive(Clone, Debug)]
enum V {
    U(u64),
    S(String),
    A(Vec<V>),
    M(Vec<(String, V)>),
    /// Bytes written as they are (types the reader must reject).
    Raw(Vec<u8>),
}

/// (type code, bytes of length after it, largest count it holds); a code
/// with 0 length bytes is a fix type, the count or-ed into it.
type Forms = &'static [(u8, usize, u64)];
const UINT: Forms = &[
    (0x00, 0, 0x7f),
    (0xcc, 1, 0xff),
    (0xcd, 2, 0xffff),
    (0xce, 4, 0xffff_ffff),
    (0xcf, 8, u64::MAX),
];
const STR: Forms = &[
    (0xa0, 0, 31),
    (0xd9, 1, 0xff),
    (0xda, 2, 0xffff),
    (0xdb, 4, 0xffff_ffff),
];
const ARRAY: Forms = &[(0x90, 0, 15), (0xdc, 2, 0xffff), (0xdd, 4, 0xffff_ffff)];
const MAP: Forms = &[(0x80, 0, 15), (0xde, 2, 0xffff), (0xdf, 4, 0xffff_ffff)];

impl V {
    fn s(s: &str) -> V {
        V::S(s.to_owned())
    }

    /// Encodes with every head `wider` forms above the smallest that fits
    /// (0: what rmp-serde writes; large: the widest form everywhere).
    fn encode(&self, wider: usize, out: &mut Vec<u8>) {
        let head = |out: &mut Vec<u8>, forms: Forms, n: u64| {
            let fit = forms.iter().position(|f| n <= f.2).unwrap();
            let (code, bytes, _) = forms[(fit + wider).min(forms.len() - 1)];
            if bytes == 0 {
                out.push(code | n as u8);
            } else {
                out.push(code);
                out.extend_from_slice(&n.to_be_bytes()[8 - bytes..]);
            }
        };
        match self {
            V::U(n) => head(out, UINT, *n),
            V::S(s) => {
                head(out, STR, s.len() as u64);
                out.extend_from_slice(s.as_bytes());
            }
            V::A(vs) => {
                head(out, ARRAY, vs.len() as u64);
                vs.iter().for_each(|v| v.encode(wider, out));
            }
            V::M(kvs) => {
                head(out, MAP, kvs.len() as u64);
                for (k, v) in kvs {
                    V::s(k).encode(wider, out);
                    v.encode(wider, out);
                }
            }
            V::Raw(b) => out.extend_from_slice(b),
        }
    }

    fn bytes(&self, wider: usize) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(wider, &mut out);
        out
    }

    /// The map entry `key`, to change in place.
    fn get(&mut self, key: &str) -> &mut V {
        match self {
            V::M(kvs) => &mut kvs.iter_mut().find(|(k, _)| k == key).unwrap().1,
            _ => panic!("not a map"),
        }
    }

    fn entries(&mut self) -> &mut Vec<(String, V)> {
        match self {
            V::M(kvs) => kvs,
            _ => panic!("not a map"),
        }
    }

    fn elems(&mut self) -> &mut Vec<V> {
        match self {
            V::A(vs) => vs,
            _ => panic!("not an array"),
        }
    }
}

/// `h` as rmp-serde's shape; with `reversed`, every map's keys in the
/// opposite order.
fn value(h: &ItemHeader, reversed: bool) -> V {
    let map = |mut kvs: Vec<(&str, V)>| {
        if reversed {
            kvs.reverse();
        }
        V::M(kvs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
    };
    let meta = h
        .meta
        .iter()
        .map(|(k, v)| V::A(vec![V::s(k), V::s(v)]))
        .collect();
    let fields = h
        .fields
        .iter()
        .map(|f| {
            map(vec![
                ("name", V::s(&f.name)),
                ("dtype", V::s(&format!("{:?}", f.dtype))),
                ("shape", V::A(f.shape.iter().map(|&d| V::U(d)).collect())),
                ("offset", V::U(f.offset)),
                ("len", V::U(f.len)),
            ])
        })
        .collect();
    map(vec![("meta", V::A(meta)), ("fields", V::A(fields))])
}

fn text() -> impl Strategy<Value = String> {
    // Lengths that take fixstr, str8 and str16.
    prop_oneof![
        30 => ".{0,40}",
        2 => "[a-z]{200,300}",
        1 => "[a-z]{65540,65560}",
    ]
}

fn header() -> impl Strategy<Value = ItemHeader> {
    let dim = prop_oneof![0u64..200, any::<u64>()];
    let field = (
        text(),
        prop::sample::select(DType::ALL.to_vec()),
        prop::collection::vec(dim, 0..=MAX_DIMS),
        any::<u64>(),
        prop_oneof![0u64..100_000, any::<u64>()],
    )
        .prop_map(|(name, dtype, shape, offset, len)| FieldSpec {
            name,
            dtype,
            shape,
            offset,
            len,
        });
    // Up to 20 entries: fixarray and array16.
    (
        prop::collection::vec((text(), text()), 0..20),
        prop::collection::vec(field, 0..20),
    )
        .prop_map(|(meta, fields)| ItemHeader { meta, fields })
}

/// A valid item object from `ItemLayout`, with small payloads.
fn item() -> impl Strategy<Value = (ItemHeader, Vec<u8>)> {
    let field = (
        ".{0,12}",
        prop::sample::select(DType::ALL.to_vec()),
        prop::collection::vec(0u64..5, 0..4),
    );
    (
        prop::collection::vec((".{0,12}", ".{0,40}"), 0..4),
        prop::collection::vec(field, 0..5),
    )
        .prop_map(|(meta, fields)| {
            let mut b = ItemLayout::new();
            for (k, v) in meta {
                b = b.meta(k, v);
            }
            for (i, (name, dtype, shape)) in fields.into_iter().enumerate() {
                // Unique: whatever `name` holds, the digits after the last
                // '#' differ.
                b = b.field(format!("{name}#{i}"), dtype, shape);
            }
            let l = b.finish().unwrap();
            let mut obj = vec![0u8; l.len()];
            l.write_header(&mut obj);
            (l.header().clone(), obj)
        })
}

proptest! {
    // Miri runs these too, a few cases only: the parsing is pure, its
    // bounds checks are what Miri looks at.
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 4 } else { 256 }, ..ProptestConfig::default() })]

    #[test]
    fn reads_what_rmp_serde_writes(h in header()) {
        let enc = rmp_serde::to_vec_named(&h).unwrap();
        let theirs: ItemHeader = rmp_serde::from_slice(&enc).unwrap();
        prop_assert_eq!(&decode(&enc).unwrap(), &theirs);
        prop_assert_eq!(&theirs, &h);
    }

    #[test]
    fn reads_wider_forms_and_other_key_orders(
        h in header(), wider in 0usize..4, reversed: bool,
    ) {
        let enc = value(&h, reversed).bytes(wider);
        prop_assert_eq!(decode(&enc).unwrap(), h);
    }

    #[test]
    fn parses_valid_items_and_views_each_field((h, obj) in item()) {
        let v = ItemView::parse(&obj).unwrap();
        prop_assert_eq!(&v.to_header(), &h);
        prop_assert_eq!(v.fields().len(), h.fields.len());
        prop_assert!(v.names().eq(h.fields.iter().map(|f| f.name.as_str())));
        for (k, _) in &h.meta {
            // The first entry with the key, as a linear search finds it.
            let first = h.meta.iter().find(|(k2, _)| k2 == k).map(|(_, v)| v.as_str());
            prop_assert_eq!(v.meta(k), first);
        }
        for f in &h.fields {
            let t = v.field(&f.name).unwrap();
            prop_assert_eq!(t.dtype(), f.dtype);
            prop_assert_eq!(t.shape(), &f.shape[..]);
            prop_assert_eq!(t.bytes().len() as u64, f.len);
            let at = t.bytes().as_ptr() as usize - obj.as_ptr() as usize;
            prop_assert_eq!(at as u64, f.offset);
        }
        let missing = matches!(v.field("no such"), Err(Error::NoSuchField { .. }));
        prop_assert!(missing);
    }

    #[test]
    fn arbitrary_header_bytes_are_an_error_or_what_rmp_serde_reads(
        bytes in prop::collection::vec(any::<u8>(), 0..300),
    ) {
        let r = decode(&bytes);
        prop_assert!(r.is_ok() || is_corrupt(&r));
        if let Ok(h) = r {
            prop_assert_eq!(rmp_serde::from_slice::<ItemHeader>(&bytes).ok(), Some(h));
        }
        let obj = object(&bytes, 4096);
        let r = ItemView::parse(&obj).map(|v| v.to_header());
        prop_assert!(r.is_ok() || is_corrupt(&r));
    }

    #[test]
    fn bit_flips_are_an_error_or_what_rmp_serde_reads(
        (_h, obj) in item(), at in any::<prop::sample::Index>(), bit in 0u8..8,
    ) {
        let hlen = u32::from_le_bytes(obj[8..12].try_into().unwrap()) as usize;
        let mut bad = obj.clone();
        let i = at.index(ITEM_PREFIX_LEN + hlen);
        bad[i] ^= 1 << bit;
        match ItemView::parse(&bad) {
            // A flip inside a string, say, can leave a valid header; it
            // must then read as rmp-serde reads it.
            Ok(v) => {
                let enc = &bad[ITEM_PREFIX_LEN..ITEM_PREFIX_LEN + hlen];
                let theirs: ItemHeader = rmp_serde::from_slice(enc).unwrap();
                prop_assert_eq!(v.to_header(), theirs);
                // Only the prefix's reserved bytes are not read.
                prop_assert!(matches!(i, 6..8 | 12..16 | ITEM_PREFIX_LEN..), "flip at {}", i);
            }
            Err(e) => prop_assert!(matches!(e, Error::CorruptObject(_)), "{e}"),
        }
    }

    #[test]
    fn truncations_are_errors((h, obj) in item()) {
        let hlen = u32::from_le_bytes(obj[8..12].try_into().unwrap()) as usize;
        let need = h
            .fields
            .iter()
            .map(|f| (f.offset + f.len) as usize)
            .max()
            .unwrap_or(0)
            .max(ITEM_PREFIX_LEN + hlen);
        // Cutting the object: fine exactly when every field still fits.
        for k in 0..obj.len() {
            let r = ItemView::parse(&obj[..k]);
            if k >= need {
                prop_assert!(r.is_ok());
            } else {
                prop_assert!(is_corrupt(&r), "cut at {k}: {r:?}");
            }
        }
        // Cutting the header (a shorter header_len) is never valid.
        for k in 0..hlen {
            let mut bad = obj.clone();
            bad[8..12].copy_from_slice(&(k as u32).to_le_bytes());
            prop_assert!(is_corrupt(&ItemView::parse(&bad)), "header cut at {k}");
        }
    }
}

fn example() -> ItemHeader {
    ItemHeader {
        meta: vec![("modality".into(), "image".into())],
        fields: vec![FieldSpec {
            name: "pixels".into(),
            dtype: DType::F32,
            shape: vec![2, 3],
            offset: 512,
            len: 24,
        }],
    }
}

/// What a Python writer (`msgpack.packb`) may do differently from rmp-serde,
/// and what the reader makes of it: documented on `ItemView::parse`.
#[test]
fn other_encoders_variants_are_accepted_or_rejected_as_documented() {
    let h = example();
    let ok = |v: &V, wider: usize| {
        let obj = object(&v.bytes(wider), 1024);
        ItemView::parse(&obj).map(|v| v.to_header())
    };
    // Accepted: keys in another order, any width (str8 for short strings,
    // uint64 for small numbers, array16/32, map16/32).
    for wider in 0..4 {
        for reversed in [false, true] {
            assert_eq!(ok(&value(&h, reversed), wider).unwrap(), h);
        }
    }
    let base = value(&h, false);
    type Edit = fn(&mut V);
    let rejected: [(&str, Edit); 14] = [
        ("unknown top-level key", |v| {
            v.entries().push(("extra".into(), V::U(1)))
        }),
        ("unknown field key", |v| {
            let f = &mut v.get("fields").elems()[0];
            f.entries().push(("stride".into(), V::A(vec![])));
        }),
        ("duplicate key", |v| {
            let m = v.get("meta").clone();
            v.entries().push(("meta".into(), m));
        }),
        ("missing 'meta'", |v| {
            v.entries().retain(|(k, _)| k != "meta")
        }),
        ("missing 'offset'", |v| {
            let f = &mut v.get("fields").elems()[0];
            f.entries().retain(|(k, _)| k != "offset");
        }),
        ("dtype as an integer", |v| {
            *v.get("fields").elems()[0].get("dtype") = V::U(10)
        }),
        ("unknown dtype", |v| {
            *v.get("fields").elems()[0].get("dtype") = V::s("f32")
        }),
        ("name as bin", |v| {
            *v.get("fields").elems()[0].get("name") = V::Raw(b"\xc4\x06pixels".to_vec())
        }),
        ("offset as int64", |v| {
            let mut b = vec![0xd3];
            b.extend_from_slice(&128i64.to_be_bytes());
            *v.get("fields").elems()[0].get("offset") = V::Raw(b);
        }),
        ("meta entry of three strings", |v| {
            v.get("meta").elems()[0].elems().push(V::s("x"))
        }),
        ("meta as nil", |v| *v.get("meta") = V::Raw(vec![0xc0])),
        ("nine dimensions", |v| {
            *v.get("fields").elems()[0].get("shape") = V::A(vec![V::U(1); 9])
        }),
        ("offset not 64-aligned", |v| {
            *v.get("fields").elems()[0].get("offset") = V::U(520)
        }),
        ("len disagrees with the shape", |v| {
            *v.get("fields").elems()[0].get("len") = V::U(20)
        }),
    ];
    for (what, edit) in rejected {
        let mut v = base.clone();
        edit(&mut v);
        for wider in [0, 3] {
            let r = ok(&v, wider);
            assert!(is_corrupt(&r), "{what} (wider {wider}): {r:?}");
        }
    }
    // A struct as an array (rmp-serde's unnamed encoding) and bytes after
    // the map are rejected too.
    let unnamed = rmp_serde::to_vec(&h).unwrap();
    assert!(is_corrupt(
        &ItemView::parse(&object(&unnamed, 1024)).map(|_| ())
    ));
    let mut trailing = base.bytes(0);
    trailing.push(0xc0);
    assert!(is_corrupt(
        &ItemView::parse(&object(&trailing, 1024)).map(|_| ())
    ));
}

#[test]
fn hostile_counts_fail_fast() {
    // A fields array claiming 2^32-1 entries, a map claiming 65535 keys, a
    // string claiming 4 GiB: rejected from the count, before any loop.
    for header in [
        &b"\x82\xa4meta\x90\xa6fields\xdd\xff\xff\xff\xff"[..],
        b"\xde\xff\xff\xa4meta\x90",
        b"\x81\xdb\xff\xff\xff\xffmeta",
    ] {
        let r = decode(header);
        assert!(is_corrupt(&r), "{r:?}");
    }
}

#[test]
fn debug_lists_the_header_not_the_bytes() {
    let h = example();
    let obj = object(&rmp_serde::to_vec_named(&h).unwrap(), 1024);
    let s = format!("{:?}", ItemView::parse(&obj).unwrap());
    assert!(s.contains("\"modality\"") && s.contains("pixels") && s.contains("object_len: 1024"));
}
