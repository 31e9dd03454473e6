//! The asynchronous device protocol, on the CPU engine (an emulated device):
//! puts are published only after their copy completes, gets release their
//! slot only after theirs. Copies in flight are made by stopping the
//! engine (`CpuEngine::pause`), never by waiting on a clock. The bodies shared
//! with the CUDA engine (`tests/gpu.rs`) are in `tests/common/engine.rs`.

mod common;

use std::time::Duration;

use common::{engine, pattern, Name};
use pinshm::testing as layout;
use pinshm::testing::{check_pack, pack_cpu, unpack_cpu};
use pinshm::{
    codec::{DType, ItemLayout},
    device::{CopyEngine, CpuEngine, PackDesc},
    Error, ObjectStore, StoreConfig, StoreReader,
};

const KIB: usize = 1024;
const MIB: usize = 1 << 20;

fn store(name: &Name, capacity: usize, max: usize) -> ObjectStore {
    ObjectStore::create(StoreConfig::new(capacity, max, 1).name(&**name)).unwrap()
}

#[test]
fn a_device_put_is_published_only_when_its_copy_completes() {
    engine::a_device_put_is_published_only_when_its_copy_completes::<CpuEngine>("cpu");
}

#[test]
fn a_dropped_device_put_frees_its_key_at_once_and_its_slot_after_its_copy() {
    let name = Name::new("devdropkey");
    let mut w = store(&name, 4 * MIB, MIB);
    let eng = CpuEngine::new();
    let len = 64 * KIB;
    let src = eng.alloc(len).unwrap();
    eng.upload(&pattern(1, len), &src).unwrap();
    let pause = eng.pause().unwrap();
    let p = w.put_from_device("k", &src, &eng).unwrap();
    assert!(w.is_pending("k") && !w.is_cached("k"));
    assert!(matches!(
        w.put("k", b"x"),
        Err(Error::DuplicateKey { pending: true, .. })
    ));
    drop(p);
    // The copy is stopped, its put given up: the key is free at once.
    assert!(!w.is_pending("k"));
    let h = w.put("k", &pattern(2, len)).unwrap();
    let r = StoreReader::attach(&w.handle()).unwrap();
    assert_eq!(r.get_copy(h).unwrap(), pattern(2, len));
    assert_eq!(
        w.stats().objects,
        2,
        "the abandoned slot stays while its copy may run"
    );
    drop(pause);
    engine::TestEngine::drain(&eng);
    drop(r.get(h).unwrap());
    assert_eq!(
        w.free_unused(),
        2,
        "the abandoned slot goes once its copy stopped"
    );
}

#[test]
fn several_device_puts_can_be_in_flight() {
    let name = Name::new("devmany");
    let mut w = store(&name, 8 * MIB, MIB);
    let eng = CpuEngine::new();
    let bufs: Vec<_> = (0..8)
        .map(|i| {
            let b = eng.alloc(100 * KIB + i).unwrap();
            eng.upload(&pattern(i as u64, 100 * KIB + i), &b).unwrap();
            b
        })
        .collect();
    // The engine's queue is stopped: had a put waited for its copy, it
    // would never return (the 60 s bound only turns that hang into a
    // failure; nothing here depends on timing).
    let pause = eng.pause().unwrap();
    let pending = std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let (w, bufs, eng) = (&mut w, &bufs, &eng);
        s.spawn(move || {
            let p: Vec<_> = bufs
                .iter()
                .enumerate()
                .map(|(i, b)| w.put_from_device(&format!("k{i}"), b, eng).unwrap())
                .collect();
            tx.send(p).unwrap();
        });
        let p = rx.recv_timeout(Duration::from_secs(60));
        if p.is_err() {
            drop(pause); // let the puts finish, so the scope can end
            panic!("starting device puts waited for their copies");
        }
        (p.unwrap(), pause)
    });
    let (pending, pause) = pending;
    for p in &pending {
        assert_eq!(w.try_finish_put(p).unwrap(), None, "copies are held");
    }
    assert_eq!(w.stats().puts, 0, "nothing is published before its copy");
    drop(pause);
    let r = StoreReader::attach(&w.handle()).unwrap();
    for (i, p) in pending.into_iter().enumerate() {
        let h = w.finish_put(p).unwrap();
        assert_eq!(r.get_copy(h).unwrap(), pattern(i as u64, 100 * KIB + i));
    }
}

#[test]
fn a_pending_put_blocks_reclaim_and_an_abandoned_one_is_freed_after_its_copy() {
    engine::an_abandoned_pending_put_frees_its_slot_only_after_its_copy::<CpuEngine>(
        "cpu",
        64 * KIB,
    );
}

#[test]
fn a_device_get_holds_its_slot_until_the_copy_completes() {
    let name = Name::new("devget");
    let len = 512 * KIB;
    let mut w = store(&name, 2 * layout::slot_len(1, len), len);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let eng = CpuEngine::new();
    let a = w.put("a", &pattern(1, len)).unwrap();
    w.put("b", &pattern(2, len)).unwrap();
    r.acknowledge(w.get_cached("b").unwrap()).unwrap();
    r.acknowledge(w.get_cached("b").unwrap()).unwrap();
    r.acknowledge(w.get_cached("b").unwrap()).unwrap(); // b: fully read
    r.acknowledge(a).unwrap(); // a is fully read: only the pending copy holds it
    let dst = eng.alloc(len).unwrap();
    let pause = eng.pause().unwrap();
    let pg = r.get_to_device(a, &dst, &eng).unwrap();
    // The copy is queued behind the pause, not done: `a` must not be
    // reclaimed, although every read it owed has been acknowledged.
    for _ in 0..3 {
        match w.put("c", &pattern(3, len)) {
            Err(Error::Full {
                blocker: Some(b), ..
            }) => assert_eq!(b.monotonic_id, a.monotonic_id),
            other => panic!("the slot under a pending copy was reclaimed: {other:?}"),
        }
    }
    assert!(!pg.poll().unwrap());
    drop(pause);
    assert_eq!(pg.wait().unwrap(), len);
    let mut out = vec![0; len];
    eng.download(&dst, &mut out).unwrap();
    assert_eq!(out, pattern(1, len), "the device got the object's bytes");
    // Completed: the slot is released.
    w.put("c", &pattern(3, len)).unwrap();
    assert!(!w.is_cached("a"));
}

/// Wraps a CPU engine's tickets so that a test learns when someone starts
/// waiting on one (while the engine is held, the wait cannot end).
struct Signalling {
    inner: CpuEngine,
    waiting: crossbeam_channel::Sender<()>,
}

#[derive(Debug)]
struct SignalledTicket {
    inner: pinshm::device::Ticket,
    waiting: crossbeam_channel::Sender<()>,
}

// SAFETY: says what the CPU engine's ticket says, and waits as it does.
unsafe impl pinshm::device::Completion for SignalledTicket {
    fn poll(&self) -> pinshm::Result<bool> {
        self.inner.poll()
    }
    fn wait(&self) -> pinshm::Result<()> {
        let _ = self.waiting.send(());
        self.inner.wait()
    }
}

impl Signalling {
    fn wrap(
        &self,
        t: pinshm::Result<pinshm::device::Ticket>,
    ) -> pinshm::Result<pinshm::device::Ticket> {
        Ok(pinshm::device::Ticket::new(SignalledTicket {
            inner: t?,
            waiting: self.waiting.clone(),
        }))
    }
}

// SAFETY: every call goes to the CPU engine; its tickets only gain a signal.
unsafe impl CopyEngine for Signalling {
    fn device(&self) -> pinshm::device::DeviceId {
        self.inner.device()
    }
    fn alloc(&self, len: usize) -> pinshm::Result<pinshm::device::DeviceBuffer> {
        self.inner.alloc(len)
    }
    fn upload(&self, src: &[u8], dst: &pinshm::device::DeviceBuffer) -> pinshm::Result<()> {
        self.inner.upload(src, dst)
    }
    fn download(&self, src: &pinshm::device::DeviceBuffer, dst: &mut [u8]) -> pinshm::Result<()> {
        self.inner.download(src, dst)
    }
    unsafe fn d2h_async(
        &self,
        src: &pinshm::device::DeviceBuffer,
        dst: *mut u8,
        keep: Option<pinshm::device::KeepAlive>,
    ) -> pinshm::Result<pinshm::device::Ticket> {
        // SAFETY: the caller's contract, passed on.
        self.wrap(unsafe { self.inner.d2h_async(src, dst, keep) })
    }
    unsafe fn h2d_async(
        &self,
        src: *const u8,
        len: usize,
        dst: &pinshm::device::DeviceBuffer,
        keep: Option<pinshm::device::KeepAlive>,
    ) -> pinshm::Result<pinshm::device::Ticket> {
        // SAFETY: the caller's contract, passed on.
        self.wrap(unsafe { self.inner.h2d_async(src, len, dst, keep) })
    }
    unsafe fn pack_async(
        &self,
        descs: &[PackDesc],
        dst: *mut u8,
        len: usize,
        keep: Option<pinshm::device::KeepAlive>,
    ) -> pinshm::Result<pinshm::device::Ticket> {
        // SAFETY: the caller's contract, passed on.
        self.wrap(unsafe { self.inner.pack_async(descs, dst, len, keep) })
    }
    unsafe fn unpack_async(
        &self,
        src: *const u8,
        len: usize,
        descs: &[PackDesc],
        keep: Option<pinshm::device::KeepAlive>,
    ) -> pinshm::Result<pinshm::device::Ticket> {
        // SAFETY: the caller's contract, passed on.
        self.wrap(unsafe { self.inner.unpack_async(src, len, descs, keep) })
    }
}

#[test]
fn dropping_a_pending_get_waits_for_its_copy() {
    let name = Name::new("devgetdrop");
    let mut w = store(&name, MIB, 64 * KIB);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let (waiting, waits) = crossbeam_channel::unbounded();
    let eng = Signalling {
        inner: CpuEngine::new(),
        waiting,
    };
    let h = w.put("a", &pattern(1, 1000)).unwrap();
    let dst = eng.alloc(1000).unwrap();
    let pause = eng.inner.pause().unwrap();
    let pg = r.get_to_device(h, &dst, &eng).unwrap();
    let (dropped, dropped_rx) = crossbeam_channel::bounded(1);
    let (seen, waited) = std::thread::scope(|s| {
        // Releases the pause once the drop waits on the copy; or, had the
        // drop returned without waiting, once it says so. The 60 s bound
        // only turns a hang into a failure.
        let releaser = s.spawn(move || {
            let waited = crossbeam_channel::select! {
                recv(waits) -> _ => true,
                recv(dropped_rx) -> _ => false,
                default(Duration::from_secs(60)) => false,
            };
            drop(pause);
            waited
        });
        drop(pg);
        // The "device" memory read directly, not through the engine's
        // queue: what the copy had written when drop returned.
        let mut v = vec![0u8; 1000];
        // SAFETY: a CPU engine buffer is host memory of dst.len() bytes; no
        // copy into it is queued but the get's.
        unsafe { std::ptr::copy_nonoverlapping(dst.ptr() as *const u8, v.as_mut_ptr(), 1000) };
        let _ = dropped.send(());
        (v, releaser.join().unwrap())
    });
    assert!(waited, "dropping a pending get did not wait on its copy");
    assert_eq!(
        seen,
        pattern(1, 1000),
        "the copy had run when drop returned"
    );
    let mut out = vec![0; 1000];
    eng.download(&dst, &mut out).unwrap();
    assert_eq!(out, pattern(1, 1000));
}

#[test]
fn tensors_and_items_round_trip_through_the_device_path() {
    engine::tensors_and_items_round_trip_through_the_device::<CpuEngine>("cpu", 32);
}

#[test]
fn pack_and_unpack_on_the_cpu_engine_match_the_cpu_reference() {
    engine::pack_and_unpack_match_the_cpu_reference::<CpuEngine>("cpu");
}

#[test]
fn pack_and_unpack_on_the_cpu_engine_match_the_cpu_reference_at_every_alignment() {
    engine::pack_and_unpack_match_the_cpu_reference_at_every_alignment::<CpuEngine>("cpu");
}

#[test]
fn the_cpu_engine_works_from_a_thread_other_than_its_creator() {
    engine::an_engine_works_from_a_thread_other_than_its_creator::<CpuEngine>("cpu");
}

#[test]
fn bad_device_input_gives_clear_errors_and_leaves_nothing_half_published() {
    let name = Name::new("devbad");
    let mut w = store(&name, MIB, 64 * KIB);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let e1 = CpuEngine::new();
    let e2 = CpuEngine::new();
    let b1 = e1.alloc(1000).unwrap();
    assert!(matches!(
        w.put_from_device("k", &b1, &e2),
        Err(Error::WrongDevice { .. })
    ));
    let big = e1.alloc(128 * KIB).unwrap();
    assert!(matches!(
        w.put_from_device("k", &big, &e1),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(
        w.put_tensor_from_device("k", DType::F32, &[10], &b1, &e1),
        Err(Error::DeviceRange(_))
    ));
    let layout = ItemLayout::new()
        .field("a", DType::U8, vec![10])
        .finish()
        .unwrap();
    assert!(matches!(
        w.put_item_from_device("k", &layout, &[], &e1),
        Err(Error::DeviceRange(_))
    ));
    assert!(!w.is_cached("k"));
    assert_eq!(w.stats().objects, 0, "nothing recorded after the errors");
    let h = w.put("k", &[7; 2000]).unwrap();
    let small = e1.alloc(100).unwrap();
    assert!(matches!(
        r.get_to_device(h, &small, &e1),
        Err(Error::DeviceRange(_))
    ));
    assert!(matches!(
        r.get_to_device(h, &b1, &e2),
        Err(Error::WrongDevice { .. })
    ));
    assert!(b1.slice(900, 200).is_err());
    // A put cleared while its copy is in flight is stale, not published.
    let sb = e1.alloc(1000).unwrap();
    let pause = e1.pause().unwrap();
    let p = w.put_from_device("p", &sb, &e1).unwrap();
    w.clear();
    drop(pause);
    assert!(matches!(w.finish_put(p), Err(Error::Stale { .. })));
    assert!(!w.is_cached("p"));
    // A token from another store is refused.
    let other_name = Name::new("devbad2");
    let mut other = store(&other_name, MIB, 64 * KIB);
    let p = other.put_from_device("x", &b1, &e1).unwrap();
    assert!(w.finish_put(p).is_err());
}

#[test]
fn pack_gathers_strided_pieces_into_one_object_and_unpack_scatters_them_back() {
    let name = Name::new("pack");
    let mut w = store(&name, 4 * MIB, MIB);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let eng = CpuEngine::new();
    // Three pieces: contiguous, strided (every other 16-byte row of a
    // 32-byte-pitch matrix), and a 0-byte one.
    let a = eng.alloc(1000).unwrap();
    eng.upload(&pattern(1, 1000), &a).unwrap();
    let m = eng.alloc(32 * 10).unwrap();
    eng.upload(&pattern(2, 320), &m).unwrap();
    let descs = [
        PackDesc::contiguous(a.ptr(), 1000, 0),
        PackDesc {
            device_ptr: m.ptr(),
            offset: 1024,
            rows: 10,
            row_bytes: 16,
            pitch: 32,
        },
        PackDesc::contiguous(a.ptr(), 0, 1184),
    ];
    assert_eq!(check_pack(&descs, 1184).unwrap(), 1160);
    // SAFETY: the pieces are live buffers of `eng`, kept until finish_put.
    let p = unsafe { w.put_packed_from_device("packed", &descs, 1184, &eng) }.unwrap();
    let h = w.finish_put(p).unwrap();
    let got = r.get_copy(h).unwrap();
    // The CPU reference computes the same bytes.
    let mut expect = vec![0u8; 1184];
    // SAFETY: as above.
    unsafe { pack_cpu(&descs, &mut expect) }.unwrap();
    assert_eq!(got[..1000], pattern(1, 1000)[..]);
    let m_bytes = pattern(2, 320);
    for row in 0..10 {
        assert_eq!(
            got[1024 + row * 16..1024 + row * 16 + 16],
            m_bytes[row * 32..row * 32 + 16]
        );
    }
    assert_eq!(got, expect);
    // Scatter back into fresh buffers.
    let a2 = eng.alloc(1000).unwrap();
    let m2 = eng.alloc(320).unwrap();
    let back = [
        PackDesc::contiguous(a2.ptr(), 1000, 0),
        PackDesc {
            device_ptr: m2.ptr(),
            offset: 1024,
            rows: 10,
            row_bytes: 16,
            pitch: 32,
        },
    ];
    // SAFETY: a2 and m2 are live buffers nobody else touches.
    unsafe { unpack_cpu(&back, &got) }.unwrap();
    let mut out = vec![0; 1000];
    eng.download(&a2, &mut out).unwrap();
    assert_eq!(out, pattern(1, 1000));
    let mut out = vec![0; 320];
    eng.download(&m2, &mut out).unwrap();
    for row in 0..10 {
        assert_eq!(
            out[row * 32..row * 32 + 16],
            m_bytes[row * 32..row * 32 + 16]
        );
    }
    // Pieces that do not fit are refused before anything runs.
    let bad = [PackDesc::contiguous(a.ptr(), 1000, 500)];
    assert!(check_pack(&bad, 1184).is_err());
    // SAFETY: refused before any copy.
    assert!(unsafe { w.put_packed_from_device("bad", &bad, 1184, &eng) }.is_err());
    let bad_pitch = [PackDesc {
        device_ptr: m.ptr(),
        offset: 0,
        rows: 2,
        row_bytes: 32,
        pitch: 16,
    }];
    assert!(check_pack(&bad_pitch, 1184).is_err());
}

#[test]
fn pin_modes_behave_without_a_gpu() {
    let gpu = {
        #[cfg(feature = "cuda")]
        {
            pinshm::device::CudaEngine::available()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    };
    let name = Name::new("pinoff");
    let w = ObjectStore::create(
        StoreConfig::new(MIB, KIB, 1)
            .name(&*name)
            .pin(pinshm::device::PinMode::Off),
    )
    .unwrap();
    assert!(!w.is_pinned());
    let auto = Name::new("pinauto");
    let wa = ObjectStore::create(StoreConfig::new(MIB, KIB, 1).name(&*auto)).unwrap();
    assert_eq!(wa.is_pinned(), gpu, "Auto pins exactly when a GPU is there");
    if !gpu {
        let req = Name::new("pinreq");
        let e = ObjectStore::create(
            StoreConfig::new(MIB, KIB, 1)
                .name(&*req)
                .pin(pinshm::device::PinMode::Require),
        )
        .unwrap_err();
        assert!(matches!(e, Error::PinUnavailable { .. }), "{e}");
        assert!(!req.exists(), "a failed create leaves no segment");
        let e = StoreReader::attach_with(
            &w.handle(),
            pinshm::store::ReaderOptions::default().pin(pinshm::device::PinMode::Require),
        )
        .unwrap_err();
        assert!(matches!(e, Error::PinUnavailable { .. }), "{e}");
        // The failed attach gave its reader slot back, still expected: the
        // writer keeps waiting for reader 0's reads.
        let mut w = w;
        w.put("x", b"x").unwrap();
        let blocker = w.stats().oldest_unread.expect("x is owed a read");
        assert_eq!(blocker.unread_by, vec![0]);
        assert!(StoreReader::attach(&w.handle()).is_ok());
    }
}

/// An engine whose copies never report their end (a lost device): it keeps
/// every keep-alive for good, as the `CopyEngine` contract asks.
struct LostEngine(CpuEngine);

#[derive(Debug)]
struct Lost;

// SAFETY: never says done (poll is false, wait is DeviceLost); the engine
// leaks every keep-alive, so the memory stays valid for good.
unsafe impl pinshm::device::Completion for Lost {
    fn poll(&self) -> pinshm::Result<bool> {
        Ok(false)
    }
    fn wait(&self) -> pinshm::Result<()> {
        Err(Error::DeviceLost {
            what: "test: the copy's end cannot be confirmed".into(),
            source: None,
        })
    }
}

// SAFETY: its tickets never say done and it leaks every keep-alive.
unsafe impl CopyEngine for LostEngine {
    fn device(&self) -> pinshm::device::DeviceId {
        self.0.device()
    }
    fn alloc(&self, len: usize) -> pinshm::Result<pinshm::device::DeviceBuffer> {
        self.0.alloc(len)
    }
    fn upload(&self, src: &[u8], dst: &pinshm::device::DeviceBuffer) -> pinshm::Result<()> {
        self.0.upload(src, dst)
    }
    fn download(&self, src: &pinshm::device::DeviceBuffer, dst: &mut [u8]) -> pinshm::Result<()> {
        self.0.download(src, dst)
    }
    unsafe fn d2h_async(
        &self,
        _: &pinshm::device::DeviceBuffer,
        _: *mut u8,
        keep: Option<pinshm::device::KeepAlive>,
    ) -> pinshm::Result<pinshm::device::Ticket> {
        std::mem::forget(keep);
        Ok(pinshm::device::Ticket::new(Lost))
    }
    unsafe fn h2d_async(
        &self,
        _: *const u8,
        _: usize,
        _: &pinshm::device::DeviceBuffer,
        keep: Option<pinshm::device::KeepAlive>,
    ) -> pinshm::Result<pinshm::device::Ticket> {
        std::mem::forget(keep);
        Ok(pinshm::device::Ticket::new(Lost))
    }
    unsafe fn pack_async(
        &self,
        _: &[PackDesc],
        _: *mut u8,
        _: usize,
        keep: Option<pinshm::device::KeepAlive>,
    ) -> pinshm::Result<pinshm::device::Ticket> {
        std::mem::forget(keep);
        Ok(pinshm::device::Ticket::new(Lost))
    }
    unsafe fn unpack_async(
        &self,
        _: *const u8,
        _: usize,
        _: &[PackDesc],
        keep: Option<pinshm::device::KeepAlive>,
    ) -> pinshm::Result<pinshm::device::Ticket> {
        std::mem::forget(keep);
        Ok(pinshm::device::Ticket::new(Lost))
    }
}

#[test]
fn a_lost_device_copy_retires_its_slot_instead_of_freeing_it() {
    let name = Name::new("devlost");
    let len = 64 * KIB;
    let mut w = store(&name, 3 * layout::slot_len(1, len), len);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let eng = LostEngine(CpuEngine::new());
    let src = eng.alloc(len).unwrap();
    // A put whose copy is lost: an error, and its slot is never reused.
    let p = w.put_from_device("lost", &src, &eng).unwrap();
    assert!(matches!(w.finish_put(p), Err(Error::DeviceLost { .. })));
    assert!(!w.is_cached("lost"));
    // A get whose copy is lost: an error, and the slot stays held.
    let h = w.put("held", &pattern(1, len)).unwrap();
    let dst = eng.alloc(len).unwrap();
    let g = r.get_to_device(h, &dst, &eng).unwrap();
    assert!(matches!(g.wait(), Err(Error::DeviceLost { .. })));
    // The ring's third slot is the last one that can be used.
    w.put("third", &pattern(2, len)).unwrap();
    drop(r.get(w.get_cached("third").unwrap()).unwrap());
    for i in 0..4 {
        let e = w.put(&format!("x{i}"), &pattern(3, len)).unwrap_err();
        assert!(matches!(e, Error::Full { .. }), "{e}");
        assert_eq!(w.free_unused(), 0, "a retired or held slot was freed");
    }
}
