//! How long the loop sleeps after a round in which nothing happened.
//!
//! The producers' delivery reports and the partitions' queues cannot be
//! waited on together, so an idle loop sleeps and looks again. Two rules:
//!
//! * An idle service sleeps doubling steps from 100 µs to 5 ms: it wakes
//!   200 times a second, and resumes quickly after a short pause.
//! * While a task's input waits on an acknowledgement (γ outputs
//!   unacknowledged, or its start marker), the steps stop at a fiftieth of
//!   how long the last such wait lasted (at least 100 µs, at most 5 ms).
//!   Waking late then adds about a fiftieth to a wait, and where a broker
//!   takes hundreds of milliseconds to acknowledge, the loop does not wake
//!   thousands of times a second for it: with a fixed 200 µs step it did,
//!   CPU taken from the brokers where they share the machine
//!   (`docs/benchmarks.md`).

use std::time::{Duration, Instant};

/// The shortest and longest sleep of an idle round.
const IDLE_WAIT_MIN: Duration = Duration::from_micros(100);
const IDLE_WAIT_MAX: Duration = Duration::from_millis(5);
/// While input waits on an acknowledgement, the longest sleep is this
/// fraction of the last such wait.
const AWAIT_WAIT_SHARE: u32 = 50;

/// The loop's idle sleeps (see the module docs).
#[derive(Debug, Default)]
pub(super) struct IdleBackoff {
    idle_rounds: u32,
    /// Since when input has waited on an acknowledgement.
    awaiting_since: Option<Instant>,
    /// How long the last wait on an acknowledgement lasted.
    last_await: Duration,
}

impl IdleBackoff {
    /// Sleeps as long as a round that did (`worked`) or did not do anything
    /// calls for; `awaiting`: a task's input waits on an acknowledgement.
    pub(super) fn after_round(&mut self, worked: bool, awaiting: bool) {
        let sleep = self.next_sleep(worked, awaiting, Instant::now());
        if !sleep.is_zero() {
            std::thread::sleep(sleep);
        }
    }

    /// The sleep after a round, at `now`.
    fn next_sleep(&mut self, worked: bool, awaiting: bool, now: Instant) -> Duration {
        if worked || !awaiting {
            if let Some(since) = self.awaiting_since.take() {
                self.last_await = now.saturating_duration_since(since);
            }
        }
        if worked {
            self.idle_rounds = 0;
            return Duration::ZERO;
        }
        self.idle_rounds = self.idle_rounds.saturating_add(1);
        let longest = if awaiting {
            self.awaiting_since.get_or_insert(now);
            (self.last_await / AWAIT_WAIT_SHARE).clamp(IDLE_WAIT_MIN, IDLE_WAIT_MAX)
        } else {
            IDLE_WAIT_MAX
        };
        IDLE_WAIT_MIN.saturating_mul(1 << self.idle_rounds.min(6)).min(longest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// The sleeps of `rounds` idle rounds from `at`, one every `every`.
    fn idle_sleeps(
        backoff: &mut IdleBackoff,
        awaiting: bool,
        at: Instant,
        every: Duration,
        rounds: u32,
    ) -> Vec<Duration> {
        (0..rounds)
            .map(|round| backoff.next_sleep(false, awaiting, at + every * round))
            .collect()
    }

    #[test]
    fn an_idle_loop_doubles_its_sleep_up_to_five_milliseconds() {
        let mut backoff = IdleBackoff::default();
        let sleeps = idle_sleeps(&mut backoff, false, Instant::now(), MS, 8);
        let micros: Vec<u128> = sleeps.iter().map(Duration::as_micros).collect();
        assert_eq!(micros, [200, 400, 800, 1_600, 3_200, 5_000, 5_000, 5_000]);
        assert_eq!(backoff.next_sleep(true, false, Instant::now()), Duration::ZERO);
        assert_eq!(backoff.next_sleep(false, false, Instant::now()).as_micros(), 200);
    }

    #[test]
    fn a_wait_on_acknowledgements_sleeps_a_fiftieth_of_the_last_one() {
        let start = Instant::now();
        let mut backoff = IdleBackoff::default();
        // No wait measured yet: the shortest sleep.
        assert_eq!(
            idle_sleeps(&mut backoff, true, start, MS, 8).iter().max(),
            Some(&IDLE_WAIT_MIN)
        );
        // That wait began at `start` and ends with a round that worked 100 ms on.
        assert_eq!(backoff.next_sleep(true, true, start + 100 * MS), Duration::ZERO);
        let sleeps = idle_sleeps(&mut backoff, true, start + 101 * MS, MS, 8);
        assert_eq!(sleeps.iter().max(), Some(&(2 * MS)), "100 ms / 50");
        // A short wait (that one, from 101 to 103 ms) brings the step down
        // again; a long one is capped.
        backoff.next_sleep(true, true, start + 103 * MS);
        assert_eq!(
            idle_sleeps(&mut backoff, true, start + 104 * MS, MS, 8).iter().max(),
            Some(&IDLE_WAIT_MIN)
        );
        backoff.next_sleep(true, true, start + 10_000 * MS);
        assert_eq!(
            idle_sleeps(&mut backoff, true, start + 10_001 * MS, MS, 8).iter().max(),
            Some(&IDLE_WAIT_MAX)
        );
    }

    #[test]
    fn input_that_stops_waiting_without_work_ends_the_wait() {
        let start = Instant::now();
        let mut backoff = IdleBackoff::default();
        idle_sleeps(&mut backoff, true, start, MS, 3);
        // Not awaiting any more (say, the task's input drained): the wait
        // that began at `start` lasted 50 ms.
        backoff.next_sleep(false, false, start + 50 * MS);
        backoff.next_sleep(true, false, start + 51 * MS);
        let sleeps = idle_sleeps(&mut backoff, true, start + 52 * MS, MS, 8);
        assert_eq!(sleeps.iter().max(), Some(&MS), "50 ms / 50");
    }
}
