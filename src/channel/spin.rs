//! The reader's spin before it sleeps: spin only while it pays, and, when
//! messages come at a steady period, only around the moment the next one is
//! due.

use std::time::{Duration, Instant};

use super::atomics::CancelFlag;

/// Below this a period is not predicted (the short-wait spin covers it).
const MIN_PERIOD: Duration = Duration::from_micros(500);
/// Above this a period is not predicted (a wake-up costs nothing there).
const MAX_PERIOD: Duration = Duration::from_secs(1);
/// Gaps in a row within tolerance of the period before it is trusted.
const MIN_STREAK: u32 = 4;
/// Added to every margin: a poll, a clock read.
const SLACK: Duration = Duration::from_micros(10);
/// The prediction window (spin) is at most this share of the period: a
/// reader at a steady cadence spins at most 1/12 of its time (8 %).
const WINDOW_SHARE: u32 = 12;
/// The longest prediction window (spin) around one arrival.
const MAX_WINDOW: Duration = Duration::from_millis(1);
/// A timed wake-up's lateness counted at most this (a preempted reader).
const MAX_OVERSHOOT: Duration = Duration::from_millis(2);
/// What a timed futex wake-up is assumed to overshoot before one is
/// measured (the default timer slack, 50 µs, plus the wake-up).
const OVERSHOOT_GUESS: Duration = Duration::from_micros(60);
/// The part of a timed wake-up's lateness that is the timer's slack (the
/// Linux default for a normal thread); the rest is the wake-up itself,
/// which a futex wake costs too.
const TIMER_SLACK: Duration = Duration::from_micros(50);

/// How a reader waits, learned from its recent receives.
///
/// **Short waits** (replies within tens of µs): `estimate` is a moving
/// average (weight 1/4) of how long recent receives waited (zero when the
/// message was there already); a wait longer than the cap sets it to twice
/// the cap. A receive spins for `min(cap, 2 × estimate + 10 µs)` while the
/// estimate is at most the cap, and not at all above it.
///
/// **A steady period** (decode steps every few ms): the policy also learns the gap between arrivals (`period`, a
/// moving average of gaps within a quarter of it), their spread (`jitter`,
/// the mean absolute deviation) and how late a timed futex wake-up comes
/// (`overshoot` and its spread). Once [`MIN_STREAK`] gaps in a row agree,
/// a receive sleeps on the futex *with a timeout* until shortly before the
/// next arrival is due, spins through a window around it, and then sleeps
/// untimed as before. The window is `3 × jitter + 2 × overshoot spread +
/// 10 µs` early and `3 × jitter + 10 µs` late, at most 1/12 of the period
/// (a reader spins at most 8 % of its time) and at most 1 ms; the timed
/// sleep ends `overshoot` earlier still, which it sleeps through. A message
/// that comes outside the window costs what a sleeping reader pays today.
///
/// Irregular gaps (one outside a quarter of the period ends the streak;
/// two in a row restart the learning), a receive that timed out after the
/// window, or a cancel, end the prediction until a new streak: the reader
/// then waits as with short waits only (sleep at once after a learned
/// spin). A receive that timed out counts as a long wait, so a reader
/// waiting in short steps (the Python binding checks for signals every
/// 100 ms) stops spinning after the first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SpinPolicy {
    cap: Duration,
    estimate: Duration,
    rhythm: Rhythm,
    stats: WaitStats,
}

/// How a reader's receives found their messages, counted since it
/// attached ([`BroadcastReader::wait_stats`](crate::BroadcastReader::wait_stats)):
/// whether the learned spin and the predicted window catch messages, or
/// the reader sleeps through and pays a futex wake-up. A `try_recv` and a
/// zero timeout are not counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WaitStats {
    /// The message was there already.
    pub ready: u64,
    /// Caught in the short spin at the start of a receive.
    pub spin: u64,
    /// Woke the reader from the timed sleep before the predicted window
    /// (it came early).
    pub early: u64,
    /// Caught in the spin around the predicted arrival.
    pub window: u64,
    /// Woke the reader from an untimed sleep (no prediction, or the
    /// message came after the window).
    pub sleep: u64,
    /// Receives that ended with no message (timed out or cancelled).
    pub gave_up: u64,
}

/// The arrivals' period, as learned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Rhythm {
    last: Option<Instant>,
    period: Duration,
    jitter: Duration,
    /// Gaps in a row within tolerance.
    streak: u32,
    /// Gaps in a row outside it.
    outliers: u32,
    overshoot: Duration,
    overshoot_dev: Duration,
}

impl Rhythm {
    fn new() -> Rhythm {
        Rhythm {
            last: None,
            period: Duration::ZERO,
            jitter: Duration::ZERO,
            streak: 0,
            outliers: 0,
            overshoot: OVERSHOOT_GUESS,
            overshoot_dev: OVERSHOOT_GUESS / 3,
        }
    }
}

/// How one receive waits ([`SpinPolicy::plan`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WaitPlan {
    /// Spin at once for this long.
    pub spin: Duration,
    /// Then, if set, `(wake, until)`: sleep on the futex until `wake`
    /// (a message ends it sooner), spin until `until`; then sleep untimed.
    pub window: Option<(Instant, Instant)>,
}

impl WaitPlan {
    /// Spin for `spin`, then sleep.
    pub(crate) fn spin(spin: Duration) -> WaitPlan {
        WaitPlan { spin, window: None }
    }
}

/// When in its wait a receive got its message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Caught {
    /// It was there already.
    #[default]
    Ready,
    /// In the spin at once.
    Spin,
    /// In the timed sleep before the window (early: a futex wake-up).
    Early,
    /// In the window's spin (the prediction hit).
    Window,
    /// In the untimed sleep (after the window, or with none).
    Sleep,
}

/// What a wait saw, for [`SpinPolicy::learn`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct WaitTrace {
    /// A timed sleep to the window's start woke this late (it ran to its
    /// end, no message came during it).
    pub overshoot: Option<Duration>,
    /// When the message came (for a wait that got one).
    pub caught: Caught,
    /// The reader slept on the futex (a sleep phase that found its message
    /// at the first look did not): only then was it seen late.
    pub slept: bool,
}

impl SpinPolicy {
    /// Spin at most `cap` on short waits (zero: never spin), as long as
    /// recent waits say pays, and around the predicted arrival when
    /// messages come at a steady period.
    pub(crate) fn new(cap: Duration) -> SpinPolicy {
        // At most MAX_SPIN, as a channel's configured spin is: deadlines
        // are `now + spin`, and a longer spin is a core spent, not a wait.
        let cap = cap.min(super::MAX_SPIN);
        SpinPolicy {
            cap,
            estimate: Duration::ZERO,
            rhythm: Rhythm::new(),
            stats: WaitStats::default(),
        }
    }

    /// The receives counted so far.
    pub(crate) fn stats(&self) -> WaitStats {
        self.stats
    }

    /// The same policy with the counts of `other` (a new spin keeps what
    /// the reader counted).
    pub(crate) fn with_stats(mut self, other: &SpinPolicy) -> SpinPolicy {
        self.stats = other.stats;
        self
    }

    /// How long the next receive spins at once before it sleeps.
    pub(crate) fn window(&self) -> Duration {
        if self.cap.is_zero() || self.estimate > self.cap {
            return Duration::ZERO;
        }
        (self.estimate * 2 + Duration::from_micros(10)).min(self.cap)
    }

    /// The period learned, once trusted.
    pub(crate) fn period(&self) -> Option<Duration> {
        let r = &self.rhythm;
        let steady = !self.cap.is_zero()
            && r.last.is_some()
            && r.streak >= MIN_STREAK
            && (MIN_PERIOD..=MAX_PERIOD).contains(&r.period)
            && r.jitter <= r.period / 8;
        steady.then_some(r.period)
    }

    /// The predicted arrival and the spin window around it: `(wake,
    /// due, until)`, where the timed sleep ends at `wake`.
    pub(crate) fn predicted(&self) -> Option<(Instant, Instant, Instant)> {
        let period = self.period()?;
        let r = &self.rhythm;
        let due = r.last? + period;
        let budget = (period / WINDOW_SHARE).min(MAX_WINDOW);
        let early = (r.jitter * 3 + r.overshoot_dev * 2 + SLACK).min(budget * 3 / 4);
        let late = (r.jitter * 3 + SLACK).min(budget - early);
        let wake = due.checked_sub(early + r.overshoot)?;
        Some((wake, due, due + late))
    }

    /// How a receive that starts at `now` waits.
    pub(crate) fn plan(&self, now: Instant) -> WaitPlan {
        let spin = self.window();
        if !spin.is_zero() {
            return WaitPlan::spin(spin);
        }
        match self.predicted() {
            Some((wake, _, until)) if now < until => WaitPlan {
                spin,
                window: Some((wake.max(now), until)),
            },
            _ => WaitPlan::spin(spin),
        }
    }

    /// A receive that started at `start` got its message at `now`, having
    /// seen `trace`.
    ///
    /// A message caught by a futex wake-up (or found waiting) was seen
    /// later than it came, by about a wake-up's latency (the measured
    /// overshoot less the timer's slack): its arrival is put that much
    /// earlier, or a late sighting would push the next prediction late, the
    /// next message would come before the window, and so on.
    pub(crate) fn learn(&mut self, start: Instant, now: Instant, trace: WaitTrace) {
        self.waited(now.saturating_duration_since(start));
        let n = match trace.caught {
            Caught::Ready => &mut self.stats.ready,
            Caught::Spin => &mut self.stats.spin,
            Caught::Early => &mut self.stats.early,
            Caught::Window => &mut self.stats.window,
            Caught::Sleep => &mut self.stats.sleep,
        };
        *n = n.saturating_add(1);
        if let Some(o) = trace.overshoot {
            self.overslept(o);
        }
        let seen_late = match trace.caught {
            Caught::Spin | Caught::Window => Duration::ZERO,
            Caught::Early | Caught::Sleep if !trace.slept => Duration::ZERO,
            Caught::Ready | Caught::Early | Caught::Sleep => self.wake_latency(),
        };
        self.arrived(now.checked_sub(seen_late).unwrap_or(now).max(start));
    }

    /// How late a sleeping reader sees a message, as learned: a timed
    /// wake-up's overshoot less the timer's slack.
    pub(crate) fn wake_latency(&self) -> Duration {
        self.rhythm.overshoot.saturating_sub(TIMER_SLACK)
    }

    /// A receive waited `waited` for its message. A wait longer than the
    /// cap says the gaps are long: no short spin until shorter waits bring
    /// the average back under the cap (three of them, from a long wait).
    pub(crate) fn waited(&mut self, waited: Duration) {
        if waited > self.cap {
            self.estimate = self.cap * 2;
        } else {
            self.estimate = self.estimate - self.estimate / 4 + waited / 4;
        }
    }

    /// A message arrived at `at` (its receive returned).
    pub(crate) fn arrived(&mut self, at: Instant) {
        let r = &mut self.rhythm;
        let Some(gap) = r.last.replace(at).map(|l| at.saturating_duration_since(l)) else {
            return;
        };
        if r.streak == 0 && r.outliers == 0 {
            // The first gap (or the first after a restart): a guess.
            r.period = gap;
            r.jitter = Duration::ZERO;
            r.streak = 1;
            return;
        }
        let dev = gap.abs_diff(r.period);
        if dev <= r.period / 4 {
            r.period = ewma(r.period, gap, 8);
            r.jitter = ewma(r.jitter, dev, 4);
            r.streak = r.streak.saturating_add(1);
            r.outliers = 0;
        } else if r.outliers >= 1 {
            // Two in a row: the period changed (or there is none).
            r.period = gap;
            r.jitter = Duration::ZERO;
            r.streak = 1;
            r.outliers = 0;
        } else {
            r.jitter = ewma(r.jitter, dev.min(r.period), 4);
            r.streak = 0;
            r.outliers = 1;
        }
    }

    /// A timed sleep meant to end at the window's start woke `by` late.
    pub(crate) fn overslept(&mut self, by: Duration) {
        let r = &mut self.rhythm;
        let by = by.min(MAX_OVERSHOOT);
        r.overshoot_dev = ewma(r.overshoot_dev, by.abs_diff(r.overshoot), 4);
        r.overshoot = ewma(r.overshoot, by, 8);
    }

    /// A receive gave up at `now` (timed out): a long wait; if the
    /// predicted window had passed with no message, the rhythm is broken.
    pub(crate) fn timed_out(&mut self, now: Instant) {
        self.gave_up();
        if self.predicted().is_some_and(|(_, _, until)| now >= until) {
            self.forget();
        }
    }

    /// A receive gave up (timed out, or was cancelled): a long wait, and
    /// no prediction until a new streak.
    pub(crate) fn gave_up(&mut self) {
        self.estimate = self.cap * 2;
        self.stats.gave_up = self.stats.gave_up.saturating_add(1);
    }

    /// Forgets the period (what was learned of the timer stays).
    pub(crate) fn forget(&mut self) {
        let r = &mut self.rhythm;
        *r = Rhythm {
            overshoot: r.overshoot,
            overshoot_dev: r.overshoot_dev,
            ..Rhythm::new()
        };
    }
}

/// `avg + (x − avg) / w`.
fn ewma(avg: Duration, x: Duration, w: u32) -> Duration {
    if x >= avg {
        avg + (x - avg) / w
    } else {
        avg - (avg - x) / w
    }
}

/// How a [`spin_until`] ended.
pub(crate) enum Spun<T> {
    /// `poll` gave this.
    Got(T),
    /// The cancel flag was set.
    Cancelled,
    /// `until` passed.
    TimeUp,
}

/// The busy wait both sides of the channel use: spins until `poll` gives
/// a value, `cancel` is set, or `until` passes, looking at the flag and
/// the clock every 64 turns and yielding the CPU then.
pub(crate) fn spin_until<T, E>(
    until: Instant,
    cancel: &CancelFlag,
    mut poll: impl FnMut() -> Result<Option<T>, E>,
) -> Result<Spun<T>, E> {
    if Instant::now() >= until {
        return Ok(Spun::TimeUp);
    }
    let mut k = 0u32;
    loop {
        std::hint::spin_loop();
        if let Some(v) = poll()? {
            return Ok(Spun::Got(v));
        }
        k = k.wrapping_add(1);
        if k % 64 == 0 {
            if cancel.is_set() {
                return Ok(Spun::Cancelled);
            }
            if Instant::now() >= until {
                return Ok(Spun::TimeUp);
            }
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: Duration = Duration::from_micros(200);
    const US: Duration = Duration::from_micros(1);
    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_spin_longer_than_max_spin_is_max_spin_and_its_plans_add_to_the_clock() {
        let t0 = Instant::now();
        let mut p = SpinPolicy::new(Duration::MAX);
        assert_eq!(p.cap, crate::channel::MAX_SPIN);
        p.gave_up();
        assert!(t0.checked_add(p.plan(t0).spin).is_some());
    }

    /// A policy that saw arrivals at `t0 + gaps[0]`, `+ gaps[1]`, …, each
    /// after a long wait (the short spin is off) and as it came, as a
    /// reader between decode steps sees them.
    fn fed(t0: Instant, gaps: impl IntoIterator<Item = Duration>) -> (SpinPolicy, Instant) {
        let mut p = SpinPolicy::new(CAP);
        let mut t = t0;
        // Seen as they came (in a spin).
        let spun = WaitTrace {
            overshoot: None,
            caught: Caught::Window,
            slept: false,
        };
        p.learn(t - 5 * MS, t, spun);
        for g in gaps {
            t += g;
            p.learn(t - g + 100 * US, t, spun);
        }
        (p, t)
    }

    #[test]
    fn a_reader_answered_within_microseconds_spins_about_that_long() {
        let mut p = SpinPolicy::new(CAP);
        for _ in 0..20 {
            p.waited(30 * US);
        }
        let w = p.window();
        assert!(w >= 30 * US && w <= 80 * US, "{w:?}");
        // The short spin wins over any prediction.
        assert_eq!(p.plan(Instant::now()), WaitPlan::spin(w));
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
    fn a_zero_cap_never_spins_nor_predicts() {
        let t0 = Instant::now();
        let mut p = SpinPolicy::new(Duration::ZERO);
        let mut t = t0;
        for _ in 0..10 {
            t += 5 * MS;
            p.learn(t - 5 * MS, t, WaitTrace::default());
        }
        assert_eq!(p.window(), Duration::ZERO);
        assert_eq!(p.period(), None);
        assert_eq!(p.plan(t + MS), WaitPlan::spin(Duration::ZERO));
    }

    #[test]
    fn a_steady_period_is_trusted_after_a_streak_and_predicts_the_next_arrival() {
        let t0 = Instant::now();
        let (p, _) = fed(t0, [5 * MS; 3]);
        assert_eq!(p.period(), None, "three gaps are not yet a streak");
        let (p, last) = fed(t0, [5 * MS; 8]);
        assert_eq!(p.period(), Some(5 * MS));
        let (wake, due, until) = p.predicted().unwrap();
        assert_eq!(due, last + 5 * MS);
        assert!(wake < due && due < until);
        // No jitter: the window is the slack, plus the guessed overshoot
        // slept through before it.
        let spin = until - (wake + OVERSHOOT_GUESS);
        assert!(spin <= 5 * MS / WINDOW_SHARE, "{spin:?}");
        // Right after the arrival, the receive sleeps until `wake`.
        let plan = p.plan(last + 50 * US);
        assert_eq!(plan.spin, Duration::ZERO);
        assert_eq!(plan.window, Some((wake, until)));
        // Inside the window: spin from now; after it: sleep.
        assert_eq!(p.plan(due).window, Some((due, until)));
        assert_eq!(p.plan(until), WaitPlan::spin(Duration::ZERO));
    }

    #[test]
    fn jitter_widens_the_window_up_to_a_twelfth_of_the_period() {
        let t0 = Instant::now();
        let wobble = |d: u32| {
            (0..16).map(move |k| 5 * MS + if k % 2 == 0 { d * US } else { Duration::ZERO })
        };
        let (quiet, _) = fed(t0, wobble(0));
        let (noisy, _) = fed(t0, wobble(40));
        let width = |p: &SpinPolicy| {
            let (w, _, u) = p.predicted().unwrap();
            u - w
        };
        assert!(width(&noisy) > width(&quiet));
        // Far more jitter than the budget: the window stops at it.
        let (wild, _) = fed(t0, wobble(400));
        let (wake, _, until) = wild.predicted().expect("400 µs in 5 ms is steady");
        let spin = until - (wake + OVERSHOOT_GUESS);
        assert!(
            spin <= wild.period().unwrap() / WINDOW_SHARE + US,
            "{spin:?}"
        );
    }

    #[test]
    fn measured_overshoot_moves_the_wake_earlier_without_widening_the_spin_much() {
        let t0 = Instant::now();
        let (mut p, _) = fed(t0, [5 * MS; 8]);
        let (w0, due, _) = p.predicted().unwrap();
        for _ in 0..64 {
            p.overslept(300 * US);
        }
        let (w1, due1, until1) = p.predicted().unwrap();
        assert_eq!(due, due1);
        assert!(w1 + 200 * US < w0, "{:?} vs {:?}", due - w1, due - w0);
        // A steady overshoot has no spread: the spin after it is short.
        let spin = until1.saturating_duration_since(w1 + 300 * US);
        assert!(spin <= 5 * MS / WINDOW_SHARE, "{spin:?}");
        // An overshoot beyond the cap counts as the cap.
        for _ in 0..64 {
            p.overslept(Duration::from_secs(1));
        }
        let (w2, _, _) = p.predicted().unwrap();
        assert!(due - w2 <= MAX_OVERSHOOT + MAX_WINDOW);
    }

    #[test]
    fn a_message_caught_by_a_futex_wake_up_is_dated_back_by_the_wake_latency() {
        let t0 = Instant::now();
        let (mut p, last) = fed(t0, [5 * MS; 8]);
        for _ in 0..64 {
            p.overslept(250 * US);
        }
        let lat = p.wake_latency();
        assert!(lat > 150 * US && lat <= 200 * US, "{lat:?}");
        let (_, due, _) = p.predicted().unwrap();
        // Woken early at `due + lat` (it came at `due`): the next one is
        // due a period after `due`, not after the sighting.
        let seen = due + lat;
        let trace = WaitTrace {
            overshoot: None,
            caught: Caught::Early,
            slept: true,
        };
        p.learn(last + 100 * US, seen, trace);
        let (_, next, _) = p.predicted().unwrap();
        assert_eq!(next, due + 5 * MS);
        // Found at the sleep's first look, before any futex wait: seen as
        // it came, not dated back.
        let mut q = p;
        let found = next + 2 * US;
        q.learn(
            next - 300 * US,
            found,
            WaitTrace {
                overshoot: None,
                caught: Caught::Early,
                slept: false,
            },
        );
        assert_eq!(q.rhythm.last, Some(found));
        // Caught in the window's spin, the sighting is the arrival.
        let at = next + 3 * US;
        let trace = WaitTrace {
            overshoot: Some(10 * US),
            caught: Caught::Window,
            slept: true,
        };
        p.learn(next - 300 * US, at, trace);
        assert_eq!(p.rhythm.last, Some(at));
    }

    #[test]
    fn a_writer_whose_steps_shift_once_is_caught_in_the_window_again_within_a_few_arrivals() {
        let t0 = Instant::now();
        let (mut p, mut t) = fed(t0, [5 * MS; 8]);
        t += 5 * MS + 400 * US; // one longer step: everything after it moves
        p.arrived(t);
        for _ in 0..4 {
            t += 5 * MS;
            p.arrived(t);
        }
        let (wake, _, until) = p.predicted().expect("still steady");
        let next = t + 5 * MS;
        assert!(wake + p.rhythm.overshoot < next && next < until);
    }

    #[test]
    fn irregular_gaps_never_predict() {
        let t0 = Instant::now();
        let gaps = [1, 7, 3, 12, 2, 9, 4, 15, 1, 6, 20, 3].map(|g| g * MS);
        let (p, last) = fed(t0, gaps);
        assert_eq!(p.period(), None);
        assert_eq!(p.plan(last + 10 * US), WaitPlan::spin(Duration::ZERO));
    }

    #[test]
    fn one_odd_gap_suspends_the_prediction_and_a_new_period_is_relearned() {
        let t0 = Instant::now();
        let (mut p, mut t) = fed(t0, [5 * MS; 8]);
        t += 9 * MS; // a late step
        p.arrived(t);
        assert_eq!(p.period(), None, "suspended after an odd gap");
        for _ in 0..MIN_STREAK + 1 {
            t += 5 * MS;
            p.arrived(t);
        }
        assert_eq!(p.period(), Some(5 * MS));
        // The cadence changes for good: relearned after two odd gaps.
        for _ in 0..2 + MIN_STREAK as usize {
            t += 20 * MS;
            p.arrived(t);
        }
        assert_eq!(p.period(), Some(20 * MS));
    }

    #[test]
    fn periods_too_short_or_too_long_are_not_predicted() {
        let t0 = Instant::now();
        let (p, _) = fed(t0, [100 * US; 10]);
        assert_eq!(p.period(), None);
        let (p, _) = fed(t0, [Duration::from_secs(2); 10]);
        assert_eq!(p.period(), None);
    }

    #[test]
    fn a_timeout_after_the_window_forgets_the_period_and_one_before_does_not() {
        let t0 = Instant::now();
        let (mut p, last) = fed(t0, [5 * MS; 8]);
        let (wake, _, until) = p.predicted().unwrap();
        p.timed_out(wake - US); // a short step that ended before the window
        assert_eq!(p.period(), Some(5 * MS));
        p.timed_out(until + 100 * MS); // nothing came: the decode stopped
        assert_eq!(p.period(), None);
        assert_eq!(p.plan(last + 200 * MS), WaitPlan::spin(Duration::ZERO));
        // The timer's learning survives.
        let mut q = p;
        q.overslept(100 * US);
        q.forget();
        assert_eq!(q.rhythm.overshoot, p.rhythm.overshoot + (40 * US) / 8);
    }
}
