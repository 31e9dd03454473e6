//! Puts whose copy into the slot finishes later (a device copy's DMA, a
//! save published on its event): begun, finished, or given up, on the
//! writer. A given-up put frees its key at once and its slot once nothing
//! can write it.

use std::sync::Arc;

use super::handle::ObjectHandle;
use super::keys::PendingCopy;
use super::writer::ObjectStore;
use crate::error::{Error, Result};
use crate::layout::ObjectKind;

impl ObjectStore {
    /// Reserves a slot for `len` payload bytes under `key`, starts `start`
    /// on its payload (a copy that finishes later) and records the slot as
    /// pending. Returns the id to finish it by. Nothing is published, and on
    /// an error nothing is recorded.
    pub(crate) fn begin_pending(
        &mut self,
        key: &str,
        len: usize,
        kind: ObjectKind,
        start: impl FnOnce(*mut u8) -> Result<Arc<dyn PendingCopy>>,
    ) -> Result<u64> {
        let r = self.reserve(key, len)?;
        let pending = start(r.payload)?;
        Ok(self.commit(r, key, len as u64, kind, Some(pending)))
    }

    /// Whether the pending put `id` has finished its copy.
    pub(crate) fn pending_done(&self, id: u64) -> bool {
        self.space
            .ring
            .find(id)
            .and_then(|s| s.value.pending.as_ref())
            .is_none_or(|p| p.is_done())
    }

    /// Waits for the pending put `id` and publishes it.
    pub(crate) fn finish_pending(&mut self, id: u64) -> Result<ObjectHandle> {
        self.check_owner()?;
        let span = self.space.ring.find_mut(id).ok_or(Error::PutNotPending {
            id,
            reason: "its slot is gone (finished and reclaimed, or failed)",
        })?;
        let address = span.pos;
        // A put is finished once: its pending copy is taken here, so a
        // second finish finds none and changes nothing.
        let Some(pending) = span.value.pending.take() else {
            return Err(Error::PutNotPending {
                id,
                reason: "it was finished already",
            });
        };
        let outcome = pending.wait();
        if let Err(e) = outcome {
            // The slot was never published: forget its key, free it in turn.
            if let Some(k) = span.value.key.take() {
                self.keys.pending.remove(&k);
            }
            if matches!(e, Error::DeviceLost { .. }) {
                // The copy may still write the slot: it stays pending, and
                // so never freed, for the life of the store.
                span.value.pending = Some(pending);
                tracing::error!(id, %e, "a device copy into a slot was lost; the slot is retired");
            } else {
                tracing::debug!(id, %e, "pending put failed");
                // The copy has stopped: the slot goes now.
                self.free_given_up(id);
            }
            return Err(e);
        }
        self.publish_slot(id, address).ok_or(Error::Stale {
            address,
            monotonic_id: id,
        })
    }

    /// Whether the pending put `id` will never be published (see
    /// [`PendingCopy::given_up`]).
    pub(super) fn given_up(&self, id: u64) -> bool {
        self.space
            .ring
            .find(id)
            .and_then(|s| s.value.pending.as_ref())
            .is_none_or(|p| p.given_up())
    }

    /// Frees `key` from the pending put that has it if that put was given
    /// up (its slot stays until nothing can write it); whether `key` is
    /// free of pending puts now.
    pub(super) fn release_given_up(&mut self, key: &str) -> bool {
        let Some(&id) = self.keys.pending.get(key) else {
            return true;
        };
        if !self.given_up(id) {
            return false;
        }
        self.forget_pending(id);
        true
    }

    /// Forgets the key of the given-up put `id` and frees its slot now if
    /// nothing can write it any more (else it goes in turn).
    pub(super) fn free_given_up(&mut self, id: u64) {
        self.forget_pending(id);
        if self.space.free_object(id, &mut self.keys, &mut self.stats) {
            self.publish_progress();
        }
    }

    /// Forgets the key of the unpublished slot `id`: a new put of the key
    /// may go ahead now, and the slot can never be published. The slot
    /// itself is freed once its copy has stopped (see `Judge::may_go`).
    pub(super) fn forget_pending(&mut self, id: u64) {
        let Some(span) = self.space.ring.find_mut(id) else {
            return;
        };
        if let Some(k) = span.value.key.take() {
            if self.keys.pending.get(&*k) == Some(&id) {
                self.keys.pending.remove(&*k);
            }
            tracing::debug!(id, key = %k, "pending put given up: its key is free");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU8, Ordering};

    use super::*;
    use crate::store::config::StoreConfig;
    use crate::store::Unlink;

    /// A copy whose outcome the test decides: 0 running, 1 done, 2 failed.
    #[derive(Debug, Default)]
    struct Staged(AtomicU8);

    impl PendingCopy for Staged {
        fn is_done(&self) -> bool {
            self.0.load(Ordering::Acquire) != 0
        }
        fn wait(&self) -> Result<()> {
            match self.0.load(Ordering::Acquire) {
                1 => Ok(()),
                2 => Err(Error::copy("the staged copy failed")),
                _ => panic!("wait on a staged copy still running"),
            }
        }
        fn abandoned(&self) -> bool {
            false
        }
        fn given_up(&self) -> bool {
            self.0.load(Ordering::Acquire) == 2
        }
    }

    fn store(tag: &str) -> (ObjectStore, Unlink) {
        let name = format!("pinshm-unit-{tag}-{}", std::process::id());
        let w = ObjectStore::create(StoreConfig::new(1 << 20, 1 << 16, 1).name(&name)).unwrap();
        (w, Unlink(name))
    }

    #[test]
    fn a_failed_copy_frees_its_key_before_its_put_is_finished_and_its_slot_when_it_is() {
        let (mut w, _unlink) = store("failedcopy");
        let copy = Arc::new(Staged::default());
        let c = Arc::clone(&copy) as Arc<dyn PendingCopy>;
        let id = w
            .begin_pending("k", 4096, ObjectKind::Raw, |_| Ok(c))
            .unwrap();
        assert!(w.is_pending("k") && !w.is_cached("k"));
        assert!(matches!(
            w.put("k", b"x"),
            Err(Error::DuplicateKey { pending: true, .. })
        ));
        copy.0.store(2, Ordering::Release);
        // Failed, not yet finished: the key is free at once.
        assert!(!w.is_pending("k"));
        let h = w.put("k", b"saved again").unwrap();
        assert_eq!(w.stats().objects, 2);
        // Finishing the failed put reports its error, frees its slot now
        // and leaves the new object of the key alone.
        assert!(w.finish_pending(id).is_err());
        assert_eq!(w.stats().objects, 1, "the failed slot went at once");
        assert_eq!(w.lookup("k"), Some(h));
        assert_eq!(w.peek(h).unwrap(), b"saved again");
    }

    #[test]
    fn a_failed_copy_finished_at_once_frees_its_slot_and_key() {
        let (mut w, _unlink) = store("failedfinish");
        let copy = Arc::new(Staged::default());
        let c = Arc::clone(&copy) as Arc<dyn PendingCopy>;
        let id = w
            .begin_pending("k", 4096, ObjectKind::Raw, |_| Ok(c))
            .unwrap();
        copy.0.store(2, Ordering::Release);
        assert!(w.finish_pending(id).is_err());
        assert_eq!(w.stats().objects, 0);
        assert!(!w.is_pending("k") && !w.is_cached("k"));
        w.put("k", b"saved again").unwrap();
    }
}
