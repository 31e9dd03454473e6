//! Futexes on words in shared memory.
//!
//! `FUTEX_WAIT` / `FUTEX_WAKE` without `FUTEX_PRIVATE_FLAG`: the kernel keys
//! a shared futex by the page behind the address (inode and offset for a
//! shared file mapping), so a waiter and a waker in different processes
//! that map the same segment at different addresses meet. Callers keep the
//! "nobody sleeps, no syscall" fast path themselves (the word is an event
//! count whose low bits count the sleepers), see `crate::channel::atomics`.

// In loom builds the channel's futex is modelled, so this goes unused.
#![cfg_attr(pinshm_loom, allow(dead_code))]

use std::sync::atomic::AtomicU32;
use std::time::Duration;

use nix::libc;

/// Sleeps while `*word == expected`, for at most `timeout` (`None`: until
/// woken). Returns on a wake, a timeout, a signal, or at once if the word
/// already differs: callers re-check their condition in every case.
pub(crate) fn wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `word` is a live, 4-aligned u32 (an AtomicU32) for the whole
    // call; FUTEX_WAIT only reads it. `ts_ptr` is null or points to a
    // timespec that outlives the call (a relative timeout, as FUTEX_WAIT
    // takes). The remaining arguments are ignored by FUTEX_WAIT.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            ts_ptr,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
    if r == -1 {
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            // Word changed, timed out, interrupted: the caller re-checks.
            Some(libc::EAGAIN) | Some(libc::ETIMEDOUT) | Some(libc::EINTR) => {}
            _ => tracing::debug!(%e, "FUTEX_WAIT failed; the caller re-checks and waits again"),
        }
    }
}

/// Wakes up to `n` sleepers of `word`; returns how many were woken.
pub(crate) fn wake(word: &AtomicU32, n: i32) -> usize {
    // SAFETY: `word` is a live, 4-aligned u32; FUTEX_WAKE does not access
    // the memory (it only hashes its address). Other arguments are ignored.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            n,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        )
    };
    if r < 0 {
        tracing::debug!(err = %std::io::Error::last_os_error(), "FUTEX_WAKE failed");
        0
    } else {
        r as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn wait_returns_at_once_when_the_word_differs() {
        let w = AtomicU32::new(1);
        let t = Instant::now();
        wait(&w, 0, Some(Duration::from_secs(5)));
        assert!(t.elapsed() < Duration::from_secs(4));
    }

    #[test]
    fn wait_times_out_and_wake_wakes() {
        let w = Arc::new(AtomicU32::new(0));
        let t = Instant::now();
        wait(&w, 0, Some(Duration::from_millis(20)));
        assert!(t.elapsed() >= Duration::from_millis(15));
        let w2 = w.clone();
        let sleeper = std::thread::spawn(move || {
            while w2.load(Ordering::Acquire) == 0 {
                wait(&w2, 0, Some(Duration::from_secs(10)));
            }
        });
        std::thread::sleep(Duration::from_millis(20));
        w.store(1, Ordering::Release);
        wake(&w, i32::MAX);
        sleeper.join().unwrap();
    }
}
