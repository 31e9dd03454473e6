//! Attaching to a segment and trusting nothing in it: every header field
//! validated and named, segments too small or not ours, handles of another
//! segment, invalid configurations, exclusive creation, a writer gone, and
//! corruption that gives errors, never panics or wild reads.

mod common;

use common::{pattern, peek, scribble, slot, store, Name, Rng};
use pinshm::testing as layout;
use pinshm::{
    codec::DType,
    store::{ObjectHandle, StoreHandle},
    Error, ObjectStore, StoreConfig, StoreReader,
};

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;

fn header_field_offset(field: &str) -> u64 {
    match field {
        "magic" => 0,
        "layout_version" => 8,
        "n_readers" => 12,
        "header_len" => 16,
        "capacity" => 24,
        "max_object_size" => 32,
        "nonce" => 40,
        "slot_prefix_len" => 48,
        "reader_entry_len" => 56,
        _ => unreachable!(),
    }
}

#[test]
fn attach_validates_every_header_field_and_names_it() {
    let cases: &[(&str, &[u8], &str)] = &[
        ("magic", b"NOTPINSH", "magic"),
        (
            "layout_version",
            &(layout::LAYOUT_VERSION + 1).to_le_bytes(),
            "layout_version",
        ),
        // The previous layout (6, with a hazard count in the header).
        (
            "layout_version",
            &(layout::LAYOUT_VERSION - 1).to_le_bytes(),
            "layout_version",
        ),
        ("n_readers", &0u32.to_le_bytes(), "n_readers"),
        (
            "n_readers",
            &(layout::MAX_READERS + 1).to_le_bytes(),
            "n_readers",
        ),
        // Within the limit, but not what the segment was made for: its
        // header is too short for that many entries.
        ("n_readers", &65u32.to_le_bytes(), "header_len"),
        ("n_readers", &3u32.to_le_bytes(), "n_readers"),
        // 62 entries of 64 B (layout 9) need a second header page.
        ("n_readers", &62u32.to_le_bytes(), "header_len"),
        ("header_len", &8192u64.to_le_bytes(), "header_len"),
        ("capacity", &(1u64 << 40).to_le_bytes(), "capacity"),
        ("capacity", &100u64.to_le_bytes(), "capacity"),
        (
            "max_object_size",
            &(1u64 << 41).to_le_bytes(),
            "max_object_size",
        ),
        ("nonce", &7u64.to_le_bytes(), "was recreated"),
        ("slot_prefix_len", &64u32.to_le_bytes(), "slot_prefix_len"),
        ("reader_entry_len", &8u32.to_le_bytes(), "reader_entry_len"),
    ];
    for (field, bytes, expect) in cases {
        let name = Name::new("hdr");
        let w = store(&name, MIB, 4 * KIB, 2);
        scribble(&name, header_field_offset(field), bytes);
        let e = StoreReader::attach(&w.handle()).unwrap_err();
        assert!(e.to_string().contains(expect), "corrupt {field}: {e}");
    }
}

#[test]
fn attach_rejects_a_segment_too_small_or_not_ours() {
    let name = Name::new("small");
    std::fs::write(name.path(), [0u8; 100]).unwrap();
    let sh = StoreHandle {
        name: name.0.clone(),
        nonce: 1,
        capacity: 4096,
        max_object_size: 64,
        n_readers: 1,
        layout_version: layout::LAYOUT_VERSION,
    };
    let e = StoreReader::attach(&sh).unwrap_err();
    assert!(matches!(e, Error::BadHeader { field: "size", .. }), "{e}");
    std::fs::write(name.path(), vec![0u8; 8192]).unwrap();
    let e = StoreReader::attach(&sh).unwrap_err();
    assert!(matches!(e, Error::BadHeader { field: "magic", .. }), "{e}");
    std::fs::remove_file(name.path()).unwrap();
    assert!(matches!(
        StoreReader::attach(&sh),
        Err(Error::NotFound { .. })
    ));
    let bad = StoreHandle {
        name: "a/b".into(),
        ..sh
    };
    assert!(matches!(
        StoreReader::attach(&bad),
        Err(Error::InvalidName { .. })
    ));
}

#[test]
fn the_handle_must_match_the_segment() {
    let name = Name::new("hmatch");
    let w = store(&name, MIB, 4 * KIB, 2);
    let sh = w.handle();
    for (bad, field) in [
        (
            StoreHandle {
                capacity: 2 * MIB as u64,
                ..sh.clone()
            },
            "capacity",
        ),
        (
            StoreHandle {
                n_readers: 3,
                ..sh.clone()
            },
            "n_readers",
        ),
        (
            StoreHandle {
                max_object_size: 1,
                ..sh.clone()
            },
            "max_object_size",
        ),
        (
            StoreHandle {
                layout_version: layout::LAYOUT_VERSION + 1,
                ..sh.clone()
            },
            "layout_version",
        ),
    ] {
        let e = StoreReader::attach(&bad).unwrap_err();
        assert!(e.to_string().contains(field), "{e}");
    }
    assert!(matches!(
        StoreReader::attach(&StoreHandle {
            nonce: sh.nonce ^ 1,
            ..sh
        }),
        Err(Error::SegmentMismatch { .. })
    ));
}

#[test]
fn invalid_configurations_are_errors() {
    for cfg in [
        StoreConfig::new(MIB, 1024, 0),
        StoreConfig::new(MIB, 1024, layout::MAX_READERS + 1),
        StoreConfig::new(0, 0, 1),
        StoreConfig::new(1000, 10, 1),
        StoreConfig::new(MIB, MIB, 1),
        StoreConfig::new(MIB, usize::MAX, 1),
        StoreConfig::new(MIB, 1024, 1).name(""),
        StoreConfig::new(MIB, 1024, 1).name("a/b"),
    ] {
        assert!(ObjectStore::create(cfg.clone()).is_err(), "{cfg:?}");
    }
}

#[test]
fn create_is_exclusive_and_drop_unlinks() {
    let name = Name::new("excl");
    let w = store(&name, MIB, 4 * KIB, 1);
    assert!(name.exists());
    let e = ObjectStore::create(StoreConfig::new(MIB, 4 * KIB, 1).name(&*name)).unwrap_err();
    assert!(matches!(e, Error::InUse { .. }), "{e}");
    assert!(e.to_string().contains("is alive"), "{e}");
    drop(w);
    assert!(!name.exists(), "the writer's drop removes the segment");
}

#[test]
fn a_reader_keeps_reading_after_the_writer_is_gone() {
    let name = Name::new("writergone");
    let mut w = store(&name, MIB, 4 * KIB, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let h = w.put("k", b"still here").unwrap();
    drop(w);
    assert!(!name.exists());
    assert_eq!(&*r.get(h).unwrap(), b"still here");
}

#[test]
fn a_corrupted_segment_gives_errors_never_panics_or_wild_reads() {
    let name = Name::new("corrupt");
    let len = 8 * KIB;
    let cap = 16 * slot(2, len);
    let mut w = store(&name, cap, len, 2);
    let sh = w.handle();
    let header_len = layout::header_len(2) as u64;
    let mut rng = Rng(0x1234_5678);
    let mut handles = Vec::new();
    for i in 0..12 {
        handles.push(
            w.put(
                &format!("k{i}"),
                &pattern(i, (rng.below(len as u64)) as usize),
            )
            .unwrap(),
        );
    }
    let r = StoreReader::attach(&sh).unwrap();
    for round in 0..400 {
        // Random bytes over the slot headers and payloads...
        for _ in 0..8 {
            let at = header_len + rng.below(cap as u64 - 16);
            scribble(&name, at, &rng.next().to_le_bytes());
        }
        // ...and over whole slot prefixes of live objects.
        let h = handles[rng.below(handles.len() as u64) as usize];
        let junk: Vec<u8> = (0..64).map(|_| rng.next() as u8).collect();
        scribble(&name, header_len + h.address + 8 * (round % 8), &junk[..8]);
        for h in handles.iter().copied().chain([ObjectHandle {
            address: rng.below(cap as u64) & !63,
            monotonic_id: rng.below(20) + 1,
            epoch: handles[0].epoch,
        }]) {
            if let Ok(g) = r.get(h) {
                // Whatever came back lies inside the data region.
                assert!(g.len() <= cap);
                std::hint::black_box(g.iter().fold(0u8, |a, &b| a ^ b));
            }
            let _ = r.get_copy(h);
            let _ = r.acknowledge(h);
        }
        // The writer keeps working over corrupted counters.
        let _ = w.put(&format!("n{round}"), &pattern(round, 100));
        let _ = w.free_unused();
    }
    // Header corruption after attach does not change the reader's bounds.
    scribble(&name, 24, &u64::MAX.to_le_bytes());
    let _ = r.get(handles[0]);
    assert!(peek(&name, 0, 8) == b"PINSHM\0\x01");
}

#[test]
fn data_region_spans_the_capacity_and_holds_every_payload_a_guard_shows() {
    let name = Name::new("data_region");
    let mut w = store(&name, 256 * KIB, 64 * KIB, 2);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let (base, len) = r.data_region().unwrap();
    assert_eq!(len, w.handle().capacity);
    for (i, n) in [1usize, 100, 4 * KIB, 60 * KIB].into_iter().enumerate() {
        let h = w.put(&format!("k{i}"), &pattern(i as u64, n)).unwrap();
        let g = r.get(h).unwrap();
        let at = g.as_ptr() as usize;
        assert!(
            at >= base && at + n <= base + len as usize,
            "payload {i} outside the region"
        );
        assert_eq!(&g[..], &pattern(i as u64, n)[..]);
    }
}

#[test]
fn the_writers_data_region_holds_every_reservation_at_the_offset_readers_see() {
    let name = Name::new("writer_region");
    let mut w = store(&name, 256 * KIB, 64 * KIB, 2);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let (wbase, wlen) = w.data_region().unwrap();
    let (rbase, rlen) = r.data_region().unwrap();
    assert_eq!((wlen, rlen), (w.handle().capacity, w.handle().capacity));
    for (i, n) in [100usize, 4 * KIB, 60 * KIB].into_iter().enumerate() {
        let mut res = w
            .reserve_tensor(&format!("k{i}"), DType::U8, &[n as u64])
            .unwrap();
        let at = res.as_mut_ptr() as usize;
        assert!(
            at >= wbase && at + res.len() <= wbase + wlen as usize,
            "reservation {i} outside"
        );
        res.bytes_mut().copy_from_slice(&pattern(i as u64, n));
        let h = w.publish(res).unwrap();
        let g = r.get_tensor(h).unwrap();
        let data = g.bytes();
        assert_eq!(
            data.as_ptr() as usize - rbase,
            at - wbase,
            "the same offset in both mappings"
        );
        assert_eq!(data, &pattern(i as u64, n)[..]);
    }
}
