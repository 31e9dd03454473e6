//! Device-path test bodies written once, run for each engine: the CPU
//! engine in `tests/device.rs` (always), the CUDA engine in `tests/gpu.rs`
//! (feature `cuda`, on a GPU).
//!
//! A body proves a state only where the engine lets the test make it:
//! [`TestEngine::gate`] stops the engine's copies (the CPU engine's
//! [`Pause`]); the CUDA engine has no gate, and there a body checks what
//! holds whatever the copy's timing. Nothing waits on a clock: a copy is
//! known to be over once [`TestEngine::drain`] returns.

use std::sync::Arc;

use super::{pattern, Name, Rng};
use pinshm::testing as layout;
use pinshm::testing::{pack_cpu, unpack_cpu};
use pinshm::{
    codec::{DType, ItemLayout},
    device::{CopyEngine, CpuEngine, PackDesc},
    testing::Pause,
    Error, ObjectStore, StoreConfig, StoreReader,
};

const MIB: usize = 1 << 20;

/// What the shared bodies need of an engine beyond [`CopyEngine`].
pub trait TestEngine: CopyEngine + Sized + 'static {
    /// An engine on the test's device.
    fn make() -> Self;
    /// A store fit for this engine (pinned where the engine is a GPU).
    fn store(name: &Name, capacity: usize, max: usize) -> ObjectStore;
    /// A reader of `w`, attached as this engine's users attach.
    fn reader(w: &ObjectStore) -> StoreReader;
    /// Stops this engine's copies until the gate drops, where the engine
    /// can be stopped; `None` where it cannot (a GPU stream).
    fn gate(&self) -> Option<Pause>;
    /// Returns once every copy started on this engine before the call has
    /// finished: an upload is ordered after them (the `CopyEngine`
    /// contract, point 3) and waited for.
    fn drain(&self) {
        let b = self.alloc(1).unwrap();
        self.upload(&[0], &b).unwrap();
    }
}

impl TestEngine for CpuEngine {
    fn make() -> Self {
        CpuEngine::new()
    }
    fn store(name: &Name, capacity: usize, max: usize) -> ObjectStore {
        ObjectStore::create(StoreConfig::new(capacity, max, 1).name(&**name)).unwrap()
    }
    fn reader(w: &ObjectStore) -> StoreReader {
        StoreReader::attach(&w.handle()).unwrap()
    }
    fn gate(&self) -> Option<Pause> {
        Some(self.pause().unwrap())
    }
}

#[cfg(feature = "cuda")]
impl TestEngine for pinshm::device::CudaEngine {
    fn make() -> Self {
        pinshm::device::CudaEngine::new(0).unwrap()
    }
    fn store(name: &Name, capacity: usize, max: usize) -> ObjectStore {
        ObjectStore::create(
            StoreConfig::new(capacity, max, 1)
                .name(&**name)
                .pin(pinshm::device::PinMode::Require),
        )
        .expect("a pinned store (is there a GPU?)")
    }
    fn reader(w: &ObjectStore) -> StoreReader {
        StoreReader::attach_with(
            &w.handle(),
            pinshm::store::ReaderOptions::default().pin(pinshm::device::PinMode::Require),
        )
        .expect("a pinned reader")
    }
    fn gate(&self) -> Option<Pause> {
        None
    }
}

/// A device put has no handle, and its key is taken, until its copy has
/// completed and `finish_put` published it.
pub fn a_device_put_is_published_only_when_its_copy_completes<E: TestEngine>(tag: &str) {
    let name = Name::new(&format!("{tag}-devput"));
    let mut w = E::store(&name, 4 * MIB, MIB);
    let eng = E::make();
    let len = 256 * 1024;
    let src = eng.alloc(len).unwrap();
    eng.upload(&pattern(1, len), &src).unwrap();
    let gate = eng.gate();
    let p = w.put_from_device("k", &src, &eng).unwrap();
    assert!(!w.is_cached("k"), "no handle before the copy completes");
    assert!(
        matches!(w.put("k", b"x"), Err(Error::DuplicateKey { .. })),
        "the key is taken"
    );
    if gate.is_some() {
        assert_eq!(w.try_finish_put(&p).unwrap(), None, "still copying");
    }
    drop(gate);
    let h = w.finish_put(p).unwrap();
    assert!(w.is_cached("k"));
    let r = E::reader(&w);
    assert_eq!(r.get_copy(h).unwrap(), pattern(1, len));
}

/// A pending put's slot is not reclaimed; abandoned (its token dropped, its
/// source buffer too), it is freed only once its copy has stopped; leaked
/// outright, the copy keeps the mapping and the device buffer.
pub fn an_abandoned_pending_put_frees_its_slot_only_after_its_copy<E: TestEngine>(
    tag: &str,
    len: usize,
) {
    let name = Name::new(&format!("{tag}-abandon"));
    let mut w = E::store(&name, 2 * layout::slot_len(1, len), len);
    let eng = E::make();
    let src = eng.alloc(len).unwrap();
    eng.upload(&pattern(1, len), &src).unwrap();
    let gate = eng.gate();
    let p = w.put_from_device("a", &src, &eng).unwrap();
    w.put("b", &pattern(2, len)).unwrap();
    assert!(
        matches!(w.put("c", &pattern(3, len)), Err(Error::Full { .. })),
        "the pending slot is not freed"
    );
    assert!(w.is_pending("a"));
    drop(p); // abandoned while the copy may still run
    drop(src); // the ticket keeps the device memory alive
    assert!(!w.is_pending("a"), "an abandoned put's key is free at once");
    // "b" is owed its reads, so "a"'s slot is the only one a put can get.
    if gate.is_some() {
        assert!(
            matches!(w.put("c", &pattern(3, len)), Err(Error::Full { .. })),
            "an abandoned put's slot was freed while its copy ran"
        );
        // Its key is free (no DuplicateKey), its slot not yet.
        assert!(
            matches!(w.put("a", &pattern(5, len)), Err(Error::Full { .. })),
            "an abandoned put's key was not free at once"
        );
    }
    drop(gate);
    eng.drain();
    // The copy has stopped: the store frees "a", and "c" takes its slot.
    w.put("c", &pattern(3, len)).unwrap();
    assert!(!w.is_cached("a"));
    let r = E::reader(&w);
    assert_eq!(
        r.get_copy(w.get_cached("c").unwrap()).unwrap(),
        pattern(3, len)
    );
    let hb = w.get_cached("b").unwrap();
    assert_eq!(r.get_copy(hb).unwrap(), pattern(2, len), "b was kept");
    drop(r.get(hb).unwrap());
    // Leaked outright: the copy holds the mapping and the device buffer.
    let src = eng.alloc(MIB.min(len)).unwrap();
    eng.upload(&pattern(4, src.len()), &src).unwrap();
    std::mem::forget(w.put_from_device("leaked", &src, &eng).unwrap());
    drop((src, r, w));
}

/// Tensors and items go to the slot from device memory and back, byte for
/// byte: a `side` × `side` f32 tensor, and an item holding it.
pub fn tensors_and_items_round_trip_through_the_device<E: TestEngine>(tag: &str, side: u64) {
    let name = Name::new(&format!("{tag}-typed"));
    let mut w = E::store(&name, 16 * MIB, 4 * MIB);
    let r = E::reader(&w);
    let eng = E::make();
    let elems = (side * side) as usize;
    let xs: Vec<f32> = (0..elems).map(|i| i as f32 * 0.5).collect();
    let src = eng.alloc(elems * 4).unwrap();
    eng.upload(bytemuck::cast_slice(&xs), &src).unwrap();
    let p = w
        .put_tensor_from_device("t", DType::F32, &[side, side], &src, &eng)
        .unwrap();
    let h = w.finish_put(p).unwrap();
    let t = r.get_tensor(h).unwrap();
    assert_eq!(t.shape(), &[side, side]);
    assert_eq!(t.as_slice::<f32>().unwrap(), &xs[..]);
    drop(t);
    let back = eng.alloc(elems * 4).unwrap();
    r.get_tensor_to_device(h, &back, &eng)
        .unwrap()
        .wait()
        .unwrap();
    let mut out = vec![0u8; elems * 4];
    eng.download(&back, &mut out).unwrap();
    assert_eq!(out, bytemuck::cast_slice::<f32, u8>(&xs));

    let layout = ItemLayout::new()
        .meta("modality", "image")
        .field("pixels", DType::F32, vec![side * side])
        .field("grid", DType::I64, vec![3])
        .finish()
        .unwrap();
    let grid = eng.alloc(24).unwrap();
    eng.upload(bytemuck::cast_slice(&[1i64, 2, 3]), &grid)
        .unwrap();
    let p = w
        .put_item_from_device("item", &layout, &[&src, &grid], &eng)
        .unwrap();
    let h = w.finish_put(p).unwrap();
    let v = r.get_item(h).unwrap();
    assert_eq!(v.meta("modality"), Some("image"));
    assert_eq!(
        v.field("pixels").unwrap().as_slice::<f32>().unwrap(),
        &xs[..]
    );
    assert_eq!(
        v.field("grid").unwrap().as_slice::<i64>().unwrap(),
        &[1, 2, 3]
    );
    drop(v);
    let whole = eng.alloc(layout.len()).unwrap();
    let n = r.get_to_device(h, &whole, &eng).unwrap().wait().unwrap();
    let mut item = vec![0u8; n];
    eng.download(&whole, &mut item).unwrap();
    assert_eq!(
        item,
        r.get_copy(h).unwrap(),
        "the whole item, byte for byte"
    );
}

/// 100 small pieces of odd sizes plus a strided 64 × 48-byte view of a
/// 64 × 128-byte matrix: the engine's pack gives the CPU reference's bytes,
/// its unpack writes the rows back and leaves the bytes between them alone.
pub fn pack_and_unpack_match_the_cpu_reference<E: TestEngine>(tag: &str) {
    let name = Name::new(&format!("{tag}-pack"));
    let mut w = E::store(&name, 16 * MIB, 4 * MIB);
    let r = E::reader(&w);
    let eng = E::make();
    let mut bufs = Vec::new();
    let mut descs = Vec::new();
    let mut host = Vec::new();
    let mut at = 0u64;
    for i in 0..100usize {
        let n = 1 + (i * 37) % 300;
        let b = eng.alloc(n).unwrap();
        let d = pattern(i as u64, n);
        eng.upload(&d, &b).unwrap();
        descs.push(PackDesc::contiguous(b.ptr(), n as u64, at));
        host.push((d, PackDesc::contiguous(0, n as u64, at)));
        at = layout::round_up(at as usize + n, 16) as u64;
        bufs.push(b);
    }
    let m = eng.alloc(64 * 128).unwrap();
    let md = pattern(999, 64 * 128);
    eng.upload(&md, &m).unwrap();
    descs.push(PackDesc {
        device_ptr: m.ptr(),
        offset: at,
        rows: 64,
        row_bytes: 48,
        pitch: 128,
    });
    let total = at as usize + 64 * 48;
    // SAFETY: every piece is a live buffer of `eng`, kept until finish_put.
    let p = unsafe { w.put_packed_from_device("packed", &descs, total, &eng) }.unwrap();
    let h = w.finish_put(p).unwrap();
    let got = r.get_copy(h).unwrap();
    // The CPU reference over host copies of the same pieces.
    let mut cpu_descs: Vec<PackDesc> = host
        .iter()
        .map(|(d, p)| PackDesc {
            device_ptr: d.as_ptr() as u64,
            ..*p
        })
        .collect();
    cpu_descs.push(PackDesc {
        device_ptr: md.as_ptr() as u64,
        offset: at,
        rows: 64,
        row_bytes: 48,
        pitch: 128,
    });
    let mut expect = vec![0u8; total];
    // SAFETY: host slices alive for the call.
    unsafe { pack_cpu(&cpu_descs, &mut expect) }.unwrap();
    assert_eq!(got, expect, "the engine's pack equals the CPU reference");
    // Unpack into fresh device buffers and compare.
    let outs: Vec<_> = host
        .iter()
        .map(|(d, _)| eng.alloc(d.len()).unwrap())
        .collect();
    let m2 = eng.alloc(64 * 128).unwrap();
    eng.upload(&vec![0; 64 * 128], &m2).unwrap();
    let mut back: Vec<PackDesc> = outs
        .iter()
        .zip(&host)
        .map(|(b, (_, p))| PackDesc {
            device_ptr: b.ptr(),
            ..*p
        })
        .collect();
    back.push(PackDesc {
        device_ptr: m2.ptr(),
        offset: at,
        rows: 64,
        row_bytes: 48,
        pitch: 128,
    });
    let g = r.get(h).unwrap();
    // SAFETY: unpack reads the guarded slot and writes the fresh buffers.
    let t = unsafe { eng.unpack_async(g.as_ptr(), g.len(), &back, None) }.unwrap();
    t.wait().unwrap();
    drop(g);
    for (b, (d, _)) in outs.iter().zip(&host) {
        let mut v = vec![0; d.len()];
        eng.download(b, &mut v).unwrap();
        assert_eq!(&v, d);
    }
    let mut v = vec![0; 64 * 128];
    eng.download(&m2, &mut v).unwrap();
    for row in 0..64 {
        assert_eq!(v[row * 128..row * 128 + 48], md[row * 128..row * 128 + 48]);
        assert!(
            v[row * 128 + 48..(row + 1) * 128].iter().all(|&x| x == 0),
            "outside the rows untouched"
        );
    }
}

/// Pieces of every alignment class (16-, 8-, 4-byte and byte paths, heads
/// and tails), dense and strided, more than one launch's worth: the engine
/// gives exactly the CPU reference's bytes, and leaves the bytes around the
/// pieces alone.
pub fn pack_and_unpack_match_the_cpu_reference_at_every_alignment<E: TestEngine>(tag: &str) {
    let name = Name::new(&format!("{tag}-align"));
    let mut w = E::store(&name, 32 * MIB, 8 * MIB);
    let r = E::reader(&w);
    let eng = E::make();
    let arena_len = 4 * MIB;
    let arena_host = pattern(42, arena_len);
    let arena = eng.alloc(arena_len).unwrap();
    eng.upload(&arena_host, &arena).unwrap();
    let mut rng = Rng(0x5eed);
    let (mut descs, mut cpu) = (Vec::new(), Vec::new());
    let mut at = 0u64;
    for i in 0..300u64 {
        // Device and packed offsets that agree modulo 16, 8, 4, or not.
        let skew = [0u64, 8, 4, 1][(i % 4) as usize];
        let dev_off = rng.below(arena_len as u64 / 2);
        // The slot's payload is 64-byte aligned, cuMemAlloc's 256-byte.
        let want = (dev_off + skew) % 16;
        at += (want + 16 - at % 16) % 16;
        let (rows, row_bytes, pitch) = match i % 3 {
            0 => (1, 1 + rng.below(5000), 0),
            1 => {
                let rb = 1 + rng.below(300);
                (1 + rng.below(40), rb, rb + rng.below(64))
            }
            _ => {
                let rb = 4 * (1 + rng.below(200));
                (1 + rng.below(40), rb, rb)
            }
        };
        let pitch = if rows == 1 { row_bytes } else { pitch };
        let d = PackDesc {
            device_ptr: arena.ptr() + dev_off,
            offset: at,
            rows,
            row_bytes,
            pitch,
        };
        cpu.push(PackDesc {
            device_ptr: arena_host.as_ptr() as u64 + dev_off,
            ..d
        });
        descs.push(d);
        at += rows * row_bytes;
    }
    let total = at as usize + 64;
    assert!(total < 8 * MIB);
    // SAFETY: the pieces are in the live `arena`, kept until finish_put.
    let p = unsafe { w.put_packed_from_device("packed", &descs, total, &eng) }.unwrap();
    let h = w.finish_put(p).unwrap();
    let mut expect = vec![0u8; total];
    // SAFETY: every piece lies in `arena_host`, alive for the call.
    unsafe { pack_cpu(&cpu, &mut expect) }.unwrap();
    let got = r.get_copy(h).unwrap();
    for (i, d) in cpu.iter().enumerate() {
        let (a, b) = (
            d.offset as usize,
            (d.offset + d.rows * d.row_bytes) as usize,
        );
        assert!(got[a..b] == expect[a..b], "piece {i} ({d:?}) differs");
    }
    // Unpack the packed object into a zeroed arena, as the CPU reference
    // unpacks it into a zeroed host copy; overlapping pieces are written
    // in order by both only when they do not overlap, so compare pieces
    // that stand alone.
    let zero = vec![0u8; arena_len];
    let arena2 = eng.alloc(arena_len).unwrap();
    eng.upload(&zero, &arena2).unwrap();
    let alone: Vec<usize> = (0..descs.len())
        .filter(|&i| {
            let span = |d: &PackDesc| {
                let s = d.device_ptr - arena.ptr();
                (s, s + d.pitch * (d.rows - 1) + d.row_bytes)
            };
            let (s, e) = span(&descs[i]);
            descs.iter().enumerate().all(|(j, o)| {
                j == i || {
                    let (os, oe) = span(o);
                    oe <= s || os >= e
                }
            })
        })
        .collect();
    assert!(alone.len() > 30, "enough pieces stand alone to compare");
    let back: Vec<PackDesc> = alone
        .iter()
        .map(|&i| PackDesc {
            device_ptr: descs[i].device_ptr - arena.ptr() + arena2.ptr(),
            ..descs[i]
        })
        .collect();
    let g = r.get(h).unwrap();
    // SAFETY: unpack reads the guarded slot and writes the zeroed arena2.
    let t = unsafe { eng.unpack_async(g.as_ptr(), g.len(), &back, None) }.unwrap();
    t.wait().unwrap();
    drop(g);
    let mut dev = vec![0u8; arena_len];
    eng.download(&arena2, &mut dev).unwrap();
    let mut want = zero.clone();
    let host_back: Vec<PackDesc> = alone
        .iter()
        .map(|&i| PackDesc {
            device_ptr: want.as_mut_ptr() as u64 + (descs[i].device_ptr - arena.ptr()),
            ..descs[i]
        })
        .collect();
    // SAFETY: every piece lies in `want`, alive and unaliased for the call.
    unsafe { unpack_cpu(&host_back, &expect) }.unwrap();
    assert!(
        dev == want,
        "unpack equals the CPU reference, bytes around untouched"
    );
}

/// An engine, its buffers and a store made on one thread work from
/// another; tickets are waited for from a third.
pub fn an_engine_works_from_a_thread_other_than_its_creator<E: TestEngine>(tag: &str) {
    let eng = Arc::new(E::make());
    let name = Name::new(&format!("{tag}-thread"));
    let w = E::store(&name, 16 * MIB, 4 * MIB);
    let data = pattern(7, 3 * MIB + 5);
    let e2 = eng.clone();
    let (w, h, src) = std::thread::spawn(move || {
        let mut w = w;
        let src = e2.alloc(data.len()).unwrap();
        e2.upload(&data, &src).unwrap();
        let p = w.put_from_device("k", &src, &*e2).unwrap();
        let h = w.finish_put(p).unwrap();
        (w, h, src)
    })
    .join()
    .unwrap();
    // Back on the creating thread: the buffer and store made over there.
    let r = E::reader(&w);
    assert_eq!(r.get_copy(h).unwrap(), pattern(7, 3 * MIB + 5));
    let dst = eng.alloc(src.len()).unwrap();
    r.get_to_device(h, &dst, &*eng).unwrap().wait().unwrap();
    let mut back = vec![0; src.len()];
    eng.download(&dst, &mut back).unwrap();
    assert_eq!(back, pattern(7, 3 * MIB + 5));
    // Tickets waited on from yet another thread.
    let e3 = eng.clone();
    let t = std::thread::spawn(move || {
        let b = e3.alloc(MIB).unwrap();
        e3.upload(&pattern(8, MIB), &b).unwrap();
        b
    })
    .join()
    .unwrap();
    let mut out = vec![0; MIB];
    eng.download(&t, &mut out).unwrap();
    assert_eq!(out, pattern(8, MIB));
}
