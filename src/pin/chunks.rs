//! Host registration in chunks: one `cuMemHostRegister` call covers at most
//! [`MAX_CHUNK`] bytes (a single call of 512 GiB or more fails; vLLM
//! registers its CPU KV cache in chunks of 64 GiB for the same reason), so a
//! larger mapping is registered as consecutive chunks, and a failure part
//! way unregisters the chunks already registered. Pure code over two
//! callbacks, so the plan and the rollback are tested without a GPU.

// Without the `cuda` feature only the tests register (with stand-ins).
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use std::time::Duration;

/// The most one registration call covers.
pub(crate) const MAX_CHUNK: usize = 64 << 30;
/// The smallest chunk `PINSHM_PIN_CHUNK_MIB` may ask for (chunks start on a
/// 2 MiB boundary of the mapping, so huge pages are never split).
pub(crate) const MIN_CHUNK: usize = 2 << 20;
/// Environment variable: a smaller chunk size, in MiB (the GPU kit checks a
/// registration of several chunks with it).
pub(crate) const CHUNK_ENV: &str = "PINSHM_PIN_CHUNK_MIB";

/// How a mapping was pinned: what [`ObjectStore::pinning`] and
/// [`StoreReader::pinning`] report (`cuMemHostRegister` faults in and locks
/// every page, about 0.1 s per GiB, in every process that maps the store).
///
/// [`ObjectStore::pinning`]: crate::ObjectStore::pinning
/// [`StoreReader::pinning`]: crate::StoreReader::pinning
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct Pinning {
    /// The bytes registered (the whole mapping).
    pub bytes: usize,
    /// The registration calls it took (chunks of at most 64 GiB).
    pub chunks: usize,
    /// How long the registration took, in this process.
    pub elapsed: Duration,
}

/// The chunk size in force: [`MAX_CHUNK`], or the smaller size
/// `PINSHM_PIN_CHUNK_MIB` asks for (rounded down to [`MIN_CHUNK`]; a value
/// that is not a number, or out of range, is ignored with a warning).
pub(crate) fn chunk_size() -> usize {
    chunk_size_from(std::env::var(CHUNK_ENV).ok().as_deref())
}

fn chunk_size_from(var: Option<&str>) -> usize {
    let Some(v) = var else {
        return MAX_CHUNK;
    };
    match v.trim().parse::<usize>() {
        Ok(mib) if (MIN_CHUNK >> 20..=MAX_CHUNK >> 20).contains(&mib) => {
            (mib << 20) / MIN_CHUNK * MIN_CHUNK
        }
        _ => {
            tracing::warn!(
                value = v,
                "{CHUNK_ENV} is not a size in MiB from 2 to 65536: chunks of 64 GiB"
            );
            MAX_CHUNK
        }
    }
}

/// The chunks of `len` bytes from `base`: `(start, len)` pairs of at most
/// `chunk` bytes each, in order, covering the range exactly.
pub(crate) fn plan(base: usize, len: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = chunk.max(1);
    (0..len)
        .step_by(chunk)
        .map(move |off| (base + off, chunk.min(len - off)))
}

/// Registers `len` bytes from `base` chunk by chunk through `register`.
/// Returns the chunks' starts (for the unregistration). If a call fails,
/// every chunk registered before it is unregistered (last first) through
/// `unregister`, and the error comes back with the failed chunk's start.
pub(crate) fn register_in_chunks<E>(
    base: usize,
    len: usize,
    chunk: usize,
    mut register: impl FnMut(usize, usize) -> Result<(), E>,
    mut unregister: impl FnMut(usize),
) -> Result<Vec<usize>, (E, usize)> {
    let mut done = Vec::new();
    for (start, n) in plan(base, len, chunk) {
        if let Err(e) = register(start, n) {
            for &s in done.iter().rev() {
                unregister(s);
            }
            return Err((e, start));
        }
        done.push(start);
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: usize = 1 << 30;

    #[test]
    fn a_130_gib_mapping_is_registered_in_three_calls_that_cover_it_exactly() {
        let base = 0x7f00_0000_0000;
        let mut calls = Vec::new();
        let starts = register_in_chunks::<()>(
            base,
            130 * GIB,
            MAX_CHUNK,
            |s, n| {
                calls.push((s, n));
                Ok(())
            },
            |_| panic!("nothing to undo"),
        )
        .unwrap();
        assert_eq!(
            calls,
            [
                (base, 64 * GIB),
                (base + 64 * GIB, 64 * GIB),
                (base + 128 * GIB, 2 * GIB)
            ]
        );
        assert_eq!(starts, [base, base + 64 * GIB, base + 128 * GIB]);
    }

    #[test]
    fn a_mapping_within_one_chunk_is_one_call_and_an_empty_one_none() {
        assert_eq!(
            plan(4096, 64 * GIB, MAX_CHUNK).collect::<Vec<_>>(),
            [(4096, 64 * GIB)]
        );
        assert_eq!(plan(4096, 0, MAX_CHUNK).count(), 0);
    }

    #[test]
    fn a_failed_chunk_unregisters_those_before_it_last_first() {
        let mut undone = Vec::new();
        let r = register_in_chunks(
            0,
            10 * MIN_CHUNK,
            3 * MIN_CHUNK,
            |s, _| {
                if s == 6 * MIN_CHUNK {
                    Err("no")
                } else {
                    Ok(())
                }
            },
            |s| undone.push(s),
        );
        assert_eq!(r, Err(("no", 6 * MIN_CHUNK)));
        assert_eq!(undone, [3 * MIN_CHUNK, 0]);
    }

    #[test]
    fn the_chunk_size_comes_from_the_environment_only_within_range() {
        assert_eq!(chunk_size_from(None), MAX_CHUNK);
        assert_eq!(chunk_size_from(Some("64")), 64 << 20);
        assert_eq!(
            chunk_size_from(Some("3")),
            MIN_CHUNK,
            "rounded down to 2 MiB"
        );
        for bad in ["0", "1", "65537", "-4", "lots", ""] {
            assert_eq!(chunk_size_from(Some(bad)), MAX_CHUNK, "{bad:?}");
        }
    }
}
