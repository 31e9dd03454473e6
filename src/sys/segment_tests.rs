//! Unit tests of `segment`.

use super::*;

/// What `PinMode::Auto` goes by in a reader: a reserved segment's
/// blocks cover its size, a sparse one's do not, and pre-faulting a
/// mapping (read faults) reads every page without changing a byte.
#[test]
fn a_reader_tells_a_reserved_segment_from_a_sparse_one() {
    let len = 4 << 20;
    let dense = format!("pinshm-unit-dense-{}", std::process::id());
    let sparse = format!("pinshm-unit-sparse-{}", std::process::id());
    let d = Segment::create(&dense, len, false, true).unwrap();
    let s = Segment::create(&sparse, len, false, false).unwrap();
    assert!(d.is_reserved());
    assert!(!s.is_reserved());
    let opened = Segment::open(&sparse, false).unwrap();
    assert!(!opened.is_reserved(), "as a reader sees it");
    d.prefault();
    opened.prefault();
    // SAFETY: in bounds of the live mapping; nobody else writes it.
    assert_eq!(unsafe { d.as_ptr().add(len - 1).read() }, 0);
}
