//! A list that holds one item in place and only more than one on the heap, for lists
//! of one in the common case: a store object almost always has one replica of one
//! piece (a batch read of fresh keys decodes, keeps and later drops one descriptor per
//! key), and a transfer task of one slice has one checksum.

use std::fmt;
use std::ops::{Deref, DerefMut};

/// A list of `T`, one item kept in place.
#[derive(Clone)]
pub struct SmallList<T>(Repr<T>);

#[derive(Clone)]
enum Repr<T> {
    /// Exactly one item.
    One(T),
    /// Any other number (none included: an empty `Vec` takes no allocation).
    Heap(Vec<T>),
}

impl<T> SmallList<T> {
    /// An empty list.
    pub const fn new() -> Self {
        SmallList(Repr::Heap(Vec::new()))
    }

    /// An empty list with room for `n` items (in place for one).
    pub fn with_capacity(n: usize) -> Self {
        if n <= 1 {
            SmallList::new()
        } else {
            SmallList(Repr::Heap(Vec::with_capacity(n)))
        }
    }

    /// Appends `item`.
    pub fn push(&mut self, item: T) {
        match &mut self.0 {
            // (An empty list made with room for several keeps its room.)
            Repr::Heap(v) if v.capacity() == 0 => self.0 = Repr::One(item),
            Repr::Heap(v) => v.push(item),
            Repr::One(_) => {
                if let Repr::One(first) = std::mem::replace(&mut self.0, Repr::Heap(Vec::new())) {
                    self.0 = Repr::Heap(vec![first, item]);
                }
            }
        }
    }

    /// Whether its one item is kept in place (for tests of that promise).
    #[cfg(test)]
    fn in_place(&self) -> bool {
        matches!(self.0, Repr::One(_))
    }
}

impl<T> Default for SmallList<T> {
    fn default() -> Self {
        SmallList::new()
    }
}

impl<T> Deref for SmallList<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.0 {
            Repr::One(item) => std::slice::from_ref(item),
            Repr::Heap(v) => v,
        }
    }
}

impl<T> DerefMut for SmallList<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.0 {
            Repr::One(item) => std::slice::from_mut(item),
            Repr::Heap(v) => v,
        }
    }
}

impl<T> From<Vec<T>> for SmallList<T> {
    fn from(mut v: Vec<T>) -> Self {
        if v.len() == 1 {
            if let Some(item) = v.pop() {
                return SmallList(Repr::One(item));
            }
        }
        SmallList(Repr::Heap(v))
    }
}

impl<T> FromIterator<T> for SmallList<T> {
    fn from_iter<I: IntoIterator<Item = T>>(items: I) -> Self {
        let mut items = items.into_iter();
        let Some(first) = items.next() else {
            return SmallList::new();
        };
        let Some(second) = items.next() else {
            return SmallList(Repr::One(first));
        };
        let mut v = Vec::with_capacity(items.size_hint().0.saturating_add(2));
        v.push(first);
        v.push(second);
        v.extend(items);
        SmallList(Repr::Heap(v))
    }
}

impl<'a, T> IntoIterator for &'a SmallList<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<T: PartialEq> PartialEq for SmallList<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: Eq> Eq for SmallList<T> {}

impl<T: fmt::Debug> fmt::Debug for SmallList<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::SmallList;

    #[test]
    fn one_item_stays_in_place_and_every_length_reads_as_its_slice() {
        for n in 0..5u32 {
            let want: Vec<u32> = (0..n).collect();
            let collected: SmallList<u32> = (0..n).collect();
            let converted = SmallList::from(want.clone());
            let mut pushed = SmallList::new();
            (0..n).for_each(|i| pushed.push(i));
            // Made with room for its items: the room is kept, not traded for a place.
            let mut roomy = SmallList::with_capacity(n as usize);
            let room = |l: &SmallList<u32>| match &l.0 {
                super::Repr::One(_) => 1,
                super::Repr::Heap(v) => v.capacity(),
            };
            let made = room(&roomy);
            assert!(n < 2 || made >= n as usize, "one item needs no room made");
            (0..n).for_each(|i| roomy.push(i));
            assert!(n < 2 || room(&roomy) == made, "{n} items fit the room made");
            for list in [&collected, &converted, &pushed, &roomy] {
                assert_eq!(&**list, &want[..]);
                assert_eq!(list.in_place(), n == 1, "{n} items");
                assert_eq!(format!("{list:?}"), format!("{want:?}"));
            }
            assert_eq!(collected, converted);
            assert_eq!(collected, pushed);
            assert_eq!(collected, roomy);
        }
    }
}
