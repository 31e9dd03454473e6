//! Private views (`StoreReader::get_private`): an object's bytes as a
//! reader's own writable copy that copies nothing until written. A write
//! never reaches the slot or another reader; the view holds the slot while
//! it lives; no page is copied until one is written (counted in
//! /proc/self/smaps); a forked child neither reads an inherited view nor
//! makes one of an inherited guard.

mod common;

use std::io::Read;

use common::{pattern, Name};
use nix::unistd::{fork, ForkResult};
use pinshm::{Error, ObjectStore, StoreConfig, StoreReader};

const KIB: usize = 1 << 10;

/// The smaps entry of the mapping that holds `addr`: (its path,
/// Private_Dirty in KiB).
fn mapping_of(addr: usize) -> (String, u64) {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut current: Option<String> = None;
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        let first = f.next().unwrap_or("");
        if let Some((lo, hi)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
            let (lo, hi) = (
                usize::from_str_radix(lo, 16).unwrap_or(usize::MAX),
                usize::from_str_radix(hi, 16).unwrap_or(0),
            );
            current = (lo <= addr && addr < hi)
                .then(|| line.split_whitespace().nth(5).unwrap_or("").to_owned());
        } else if first == "Private_Dirty:" {
            if let Some(path) = current.take() {
                return (path, f.next().unwrap().parse().unwrap());
            }
        }
    }
    panic!("no mapping holds {addr:#x}")
}

#[test]
fn a_write_into_a_private_view_reaches_neither_the_slot_nor_another_reader() {
    let name = Name::new("priv-isolated");
    let len = 64 * KIB + 100; // spans pages, ends mid-page
    let mut w = ObjectStore::create(
        StoreConfig::new(1 << 20, 128 * KIB, 2)
            .name(&*name)
            .cache(true),
    )
    .unwrap();
    // A first object, so the second starts mid-page.
    w.put("pad", &pattern(0, 1000)).unwrap();
    let want = pattern(1, len);
    let h = w.put("a", &want).unwrap();
    let r0 = StoreReader::attach_as(&w.handle(), 0).unwrap();
    let r1 = StoreReader::attach_as(&w.handle(), 1).unwrap();
    let mut mine = r0.get_private(h).unwrap();
    let theirs = r1.get_private(h).unwrap();
    assert_eq!(
        &mine[..],
        &want[..],
        "a private view reads the object's bytes"
    );
    mine[0] ^= 0xff;
    mine[len - 1] ^= 0xff;
    mine[len / 2..len / 2 + 4096].fill(7);
    assert_ne!(&mine[..], &want[..]);
    assert_eq!(&theirs[..], &want[..], "another reader's view is unchanged");
    assert_eq!(&r1.get(h).unwrap()[..], &want[..], "the slot is unchanged");
    assert_eq!(
        &r0.get_private(h).unwrap()[..],
        &want[..],
        "a second view of the same reader is unchanged"
    );
}

#[test]
fn a_private_view_copies_no_page_until_one_is_written() {
    let name = Name::new("priv-nocopy");
    let len = 1 << 20;
    let mut w = ObjectStore::create(
        StoreConfig::new(4 << 20, 2 << 20, 1)
            .name(&*name)
            .cache(true),
    )
    .unwrap();
    let h = w.put("a", &pattern(2, len)).unwrap();
    let r = StoreReader::attach(&w.handle()).unwrap();
    let mut v = r.get_private(h).unwrap();
    let sum: u64 = v.iter().map(|&b| b as u64).sum(); // read every byte
    assert!(sum > 0);
    let addr = v.as_mut_ptr() as usize;
    let (path, dirty) = mapping_of(addr + len / 2);
    assert!(
        path.ends_with(&*name),
        "the view maps the segment's file, not a copy: {path}"
    );
    assert_eq!(dirty, 0, "no page copied by reading");
    v[len / 2] = !v[len / 2];
    let (_, dirty) = mapping_of(addr + len / 2);
    assert!(
        (4..=8).contains(&dirty),
        "one page copied by one write: {dirty} KiB"
    );
}

#[test]
fn a_private_view_holds_its_slot_while_the_ring_turns_over() {
    let name = Name::new("priv-held");
    let len = 16 * KIB;
    let slots = 8;
    let mut w = ObjectStore::create(
        StoreConfig::new(slots * StoreConfig::slot_len(1, len), len, 1)
            .name(&*name)
            .cache(true),
    )
    .unwrap();
    let r = StoreReader::attach(&w.handle()).unwrap();
    let want = pattern(3, len);
    let h = w.put("held", &want).unwrap();
    let mut v = r.get_private(h).unwrap();
    v[..4].copy_from_slice(b"MINE");
    for i in 0..10 * slots {
        w.put(&format!("k{i}"), &pattern(100 + i as u64, len))
            .unwrap();
    }
    assert_eq!(&v[..4], b"MINE");
    assert_eq!(
        &v[4..],
        &want[4..],
        "the unwritten pages still read the held object"
    );
    assert!(w.is_cached("held"), "the held object was never reclaimed");
    drop(v);
    for i in 0..2 * slots {
        w.put(&format!("j{i}"), &pattern(500 + i as u64, len))
            .unwrap();
    }
    assert!(!w.is_cached("held"), "let go when the view dropped");
    assert!(matches!(r.get_private(h), Err(Error::Stale { .. })));
}

#[test]
fn an_empty_object_has_an_empty_private_view() {
    let name = Name::new("priv-empty");
    let mut w = ObjectStore::create(
        StoreConfig::new(1 << 16, 1 << 12, 1)
            .name(&*name)
            .cache(true),
    )
    .unwrap();
    let h = w.put("e", b"").unwrap();
    let r = StoreReader::attach(&w.handle()).unwrap();
    assert!(r.get_private(h).unwrap().is_empty());
}

/// A forked child: an inherited view faults instead of reading a slot the
/// parent let go, and an inherited guard makes no view.
#[test]
fn a_forked_child_neither_reads_an_inherited_view_nor_makes_one() {
    let name = Name::new("priv-fork");
    let len = 16 * KIB;
    let mut w =
        ObjectStore::create(StoreConfig::new(4 * len, len, 1).name(&*name).cache(true)).unwrap();
    let r = StoreReader::attach_as(&w.handle(), 0).unwrap();
    let old = pattern(4, len);
    let h = w.put("a", &old).unwrap();
    let v = r.get_private(h).unwrap();
    let g = r.get(h).unwrap();
    let (mut go_r, mut go_w) = std::os::unix::net::UnixStream::pair().unwrap();
    // SAFETY: the child reads a socket, tries the guard, compares bytes and
    // _exits; it takes no lock a parent thread could hold.
    let child = match unsafe { fork() }.unwrap() {
        ForkResult::Child => {
            let made = matches!(g.into_private(), Err(Error::Forked { .. }));
            let mut b = [0u8; 1];
            let _ = go_r.read_exact(&mut b);
            if !made {
                // SAFETY: _exit ends the child at once.
                unsafe { nix::libc::_exit(2) }
            }
            let same = v[..] == old[..];
            // SAFETY: as above.
            unsafe { nix::libc::_exit(if same { 0 } else { 1 }) }
        }
        ForkResult::Parent { child } => child,
    };
    drop(v);
    drop(g);
    drop(r);
    let codes = [
        (2, "the child made a view of an inherited guard"),
        (1, "the child read the reused slot's new bytes"),
    ];
    common::reuse_then_expect_fault(&mut w, "a", len, &mut go_w, child, &codes);
}
