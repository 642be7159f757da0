//! A cold bucket's entries: slot indices in the order they cooled, taken
//! from the front, pushed at the back, and read whole as one slice.
//!
//! A vector read from `head` on, not a ring buffer: a backup reads a bucket
//! entry by entry (the class cut in part from its front, a sift through all
//! of it), and indexing a ring wraps at every entry, where a slice's index
//! is one addition. The entries taken from the front stay in the vector
//! until they are more than half of it, then go in one move, so each entry
//! is moved at most once for each time it is taken or pushed, and the
//! vector holds at most about twice what the bucket does.

#[derive(Clone, Debug, Default)]
pub(super) struct Bucket {
    entries: Vec<u32>,
    /// Where the bucket starts: the entries before were taken.
    head: usize,
}

impl Bucket {
    #[inline]
    pub(super) fn push_back(&mut self, index: u32) {
        self.entries.push(index);
    }

    /// The oldest entry, taken out of the bucket.
    #[inline]
    pub(super) fn pop_front(&mut self) -> Option<u32> {
        let index = *self.entries.get(self.head)?;
        self.head += 1;
        Some(index)
    }

    /// The entry `position` places from the front.
    #[inline]
    pub(super) fn get(&self, position: usize) -> Option<&u32> {
        self.entries.get(self.head + position)
    }

    pub(super) fn len(&self) -> usize {
        self.entries.len() - self.head
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The entries, oldest first, to read and rewrite in place.
    pub(super) fn as_mut_slice(&mut self) -> &mut [u32] {
        &mut self.entries[self.head..]
    }

    /// Keeps the `len` oldest entries.
    pub(super) fn truncate(&mut self, len: usize) {
        self.entries.truncate(self.head + len);
        self.settle();
    }

    /// Lets the entries taken go once they are more than half the vector.
    pub(super) fn settle(&mut self) {
        if self.head > self.entries.len() / 2 {
            self.entries.drain(..self.head);
            self.head = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_gives_its_entries_oldest_first_and_lets_the_taken_go() {
        let mut bucket = Bucket::default();
        for index in 0..10 {
            bucket.push_back(index);
        }
        assert_eq!([bucket.pop_front(), bucket.pop_front()], [Some(0), Some(1)]);
        assert_eq!(
            (bucket.len(), bucket.get(0), bucket.get(7), bucket.get(8)),
            (8, Some(&2), Some(&9), None)
        );
        bucket.settle();
        assert_eq!(
            bucket.entries.len(),
            10,
            "two taken of ten stay until they are more than half"
        );
        for _ in 0..4 {
            bucket.pop_front();
        }
        bucket.settle();
        assert_eq!((bucket.head, bucket.entries.as_slice()), (0, [6, 7, 8, 9].as_slice()));
        assert_eq!(bucket.pop_front(), Some(6));
        bucket.as_mut_slice()[1] = 9;
        bucket.truncate(2);
        assert_eq!(bucket.as_mut_slice(), [7, 9], "kept from the head on");
        assert_eq!(
            [bucket.pop_front(), bucket.pop_front(), bucket.pop_front()],
            [Some(7), Some(9), None]
        );
        bucket.settle();
        assert_eq!((bucket.head, bucket.entries.len(), bucket.is_empty()), (0, 0, true));
    }
}
