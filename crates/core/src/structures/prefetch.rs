//! Asking for memory a loop will read a few steps ahead.
//!
//! A backup reads and writes its slots in the order of a list of indices
//! (the keys changed since they were last written), which lands anywhere in
//! arrays larger than the cache: each step waits for memory. The steps do not
//! depend on one another, so fetching the cache line of a later step while
//! this one runs overlaps those waits. A prefetch is only a hint: it never
//! faults and changes no value, so an index out of range is skipped and
//! other targets do nothing.

/// How many steps ahead a loop over listed indices asks for its memory: far
/// enough for a fetch from memory to land, near enough to stay in cache.
pub(crate) const AHEAD: usize = 8;

/// Calls `fetch` with each step whose memory a loop asks for at step
/// `position`: the one `AHEAD` on, and at the first step every one before
/// it too. A backup of a few records (a list shorter than `AHEAD`) thus has
/// all of its lines asked for at once, so that their waits overlap, rather
/// than one miss after another.
#[inline(always)]
pub(crate) fn fetch_ahead(position: usize, mut fetch: impl FnMut(usize)) {
    if position == 0 {
        for step in 1..=AHEAD {
            fetch(step);
        }
    } else {
        fetch(position + AHEAD);
    }
}

/// Asks for the cache line of `items[index]`, if there is one.
#[inline(always)]
pub(crate) fn prefetch<T>(items: &[T], index: usize) {
    if let Some(item) = items.get(index) {
        prefetch_address(item as *const T as *const i8);
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_address(address: *const i8) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    // SAFETY: a prefetch reads nothing and cannot fault, whatever the
    // address; `address` points into a live slice besides.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(address) }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn prefetch_address(_address: *const i8) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_asks_for_its_first_steps_at_once_then_one_step_ahead() {
        let steps = |position| {
            let mut steps = Vec::new();
            fetch_ahead(position, |step| steps.push(step));
            steps
        };
        assert_eq!(steps(0), (1..=AHEAD).collect::<Vec<_>>());
        assert_eq!(steps(1), [AHEAD + 1]);
        assert_eq!(steps(5), [AHEAD + 5]);
    }
}
