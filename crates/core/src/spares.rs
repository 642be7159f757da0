//! Buffers of done backups kept for the next ones.
//!
//! Where a broker's round trip is long next to the backups' pace, hundreds
//! of backups are in flight, and where drift is spread thin (a late stage
//! of SGD) a backup writes thousands of records. A buffer taken new grows by
//! doubling, copying what it holds at each step, and half a megabyte taken
//! and given back each backup costs page faults. So buffers are kept: at
//! most `MOST` of them while their room together is within `ROOM`, and a
//! backup takes the roomiest, so that a large one finds room. A buffer
//! larger than all of `ROOM` (a complete backup's) is let go.

/// A buffer whose room is worth keeping.
pub(crate) trait Room: Default {
    /// The room it holds, in the unit of the pool's budget.
    fn room(&self) -> usize;
}

impl<T> Room for Vec<T> {
    fn room(&self) -> usize {
        self.capacity()
    }
}

/// Up to `MOST` buffers whose room together is within `ROOM`.
#[derive(Clone, Debug)]
pub(crate) struct Spares<T, const MOST: usize, const ROOM: usize> {
    kept: Vec<T>,
    /// The room of the buffers kept, together.
    room: usize,
}

impl<T, const MOST: usize, const ROOM: usize> Default for Spares<T, MOST, ROOM> {
    fn default() -> Self {
        Spares {
            kept: Vec::new(),
            room: 0,
        }
    }
}

impl<T: Room, const MOST: usize, const ROOM: usize> Spares<T, MOST, ROOM> {
    /// The roomiest buffer kept, or a new one. As it was given back: the
    /// caller empties it.
    pub(crate) fn take(&mut self) -> T {
        let roomiest = (0..self.kept.len()).max_by_key(|&i| self.kept[i].room());
        match roomiest {
            Some(i) => {
                let buffer = self.kept.swap_remove(i);
                self.room -= buffer.room();
                buffer
            }
            None => T::default(),
        }
    }

    /// Keeps `buffer` if the budget allows it, else lets it go.
    pub(crate) fn give(&mut self, buffer: T) {
        if self.kept.len() < MOST && self.room + buffer.room() <= ROOM {
            self.room += buffer.room();
            self.kept.push(buffer);
        }
    }
}

/// What the tests of the pool's owners look into.
#[cfg(test)]
impl<T, const MOST: usize, const ROOM: usize> Spares<T, MOST, ROOM> {
    pub(crate) fn len(&self) -> usize {
        self.kept.len()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.kept.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_roomiest_goes_first_and_the_budget_holds() {
        let mut spares = Spares::<Vec<u8>, 3, 100>::default();
        for room in [10, 60, 20] {
            spares.give(Vec::with_capacity(room));
        }
        assert!(spares.take().capacity() >= 60);
        // 10 + 20 kept: 80 more would pass 100.
        spares.give(Vec::with_capacity(80));
        assert_eq!(spares.len(), 2);
        spares.give(Vec::with_capacity(5));
        spares.give(Vec::with_capacity(5));
        assert_eq!(spares.len(), 3, "at most three kept");
        assert!(spares.iter().map(Vec::capacity).sum::<usize>() <= 100);
    }
}
