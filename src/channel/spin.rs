//! The reader's spin before it sleeps: spin only while it pays.

use std::time::Duration;

/// How long a reader spins before it sleeps, learned from its recent
/// waits: it spins only when the next message is likely to come within the
/// window, and then only about as long as the recent waits were.
///
/// `estimate` is a moving average (weight 1/4) of how long recent receives
/// waited for their message (zero when it was there already); a wait longer
/// than the cap sets it to twice the cap. A receive spins for
/// `min(cap, 2 × estimate + 10 µs)` while the estimate is at most the cap,
/// and not at all above it: a reader
/// whose messages come 5 ms apart (decode steps) sleeps at once, one whose
/// messages come back to back (or that is answered within tens of µs) spins
/// through the gap and never pays a futex wake-up. A receive that timed
/// out counts as a long wait, so a reader waiting in short steps (the
/// Python binding checks for signals every 100 ms) stops spinning after
/// the first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpinPolicy {
    cap: Duration,
    estimate: Duration,
    /// Always spin for `cap`, whatever the waits (for comparison, and for
    /// a reader that has a core to itself).
    fixed: bool,
}

impl SpinPolicy {
    /// Spin at most `cap` (zero: never spin), as long as recent waits say
    /// pays.
    pub fn new(cap: Duration) -> SpinPolicy {
        SpinPolicy {
            cap,
            estimate: Duration::ZERO,
            fixed: false,
        }
    }

    /// Always spin for `spin` before sleeping (what a fixed busy window
    /// does: vLLM's readers spin this way).
    pub fn fixed(spin: Duration) -> SpinPolicy {
        SpinPolicy {
            fixed: true,
            ..SpinPolicy::new(spin)
        }
    }

    /// The longest spin.
    pub fn cap(&self) -> Duration {
        self.cap
    }

    /// How long the next receive spins before it sleeps.
    pub fn window(&self) -> Duration {
        if self.fixed {
            return self.cap;
        }
        if self.cap.is_zero() || self.estimate > self.cap {
            return Duration::ZERO;
        }
        (self.estimate * 2 + Duration::from_micros(10)).min(self.cap)
    }

    /// A receive waited `waited` for its message. A wait longer than the
    /// cap says the gaps are long: no spin until shorter waits bring the
    /// average back under the cap (three of them, from a long wait).
    pub fn waited(&mut self, waited: Duration) {
        if waited > self.cap {
            self.gave_up();
        } else {
            self.estimate = self.estimate - self.estimate / 4 + waited / 4;
        }
    }

    /// A receive gave up (timed out, or was cancelled): a long wait.
    pub fn gave_up(&mut self) {
        self.estimate = self.cap * 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: Duration = Duration::from_micros(200);
    const US: Duration = Duration::from_micros(1);

    #[test]
    fn a_reader_answered_within_microseconds_spins_about_that_long() {
        let mut p = SpinPolicy::new(CAP);
        for _ in 0..20 {
            p.waited(30 * US);
        }
        let w = p.window();
        assert!(w >= 30 * US && w <= 80 * US, "{w:?}");
    }

    #[test]
    fn a_reader_between_decode_steps_sleeps_at_once() {
        let mut p = SpinPolicy::new(CAP);
        p.waited(5_000 * US);
        assert_eq!(p.window(), Duration::ZERO);
        p.waited(5_000 * US);
        assert_eq!(p.window(), Duration::ZERO);
    }

    #[test]
    fn after_a_pause_short_waits_bring_the_spin_back_and_timeouts_stop_it() {
        let mut p = SpinPolicy::new(CAP);
        p.waited(5_000 * US);
        let mut n = 0;
        while p.window().is_zero() {
            p.waited(Duration::ZERO);
            n += 1;
            assert!(n < 10, "the spin never came back");
        }
        assert!(p.window() <= CAP);
        p.gave_up();
        assert_eq!(p.window(), Duration::ZERO);
    }

    #[test]
    fn a_zero_cap_never_spins() {
        let mut p = SpinPolicy::new(Duration::ZERO);
        p.waited(Duration::ZERO);
        assert_eq!(p.window(), Duration::ZERO);
    }
}
