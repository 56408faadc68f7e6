//! A list that holds one item in place and only more than one on the heap. An object
//! almost always has one replica of one piece: its descriptor then takes no
//! allocation for either list (a batch read of fresh keys decodes, keeps and later
//! drops one descriptor per key).

use std::fmt;
use std::ops::{Deref, DerefMut};

/// A list of `T`, one item kept in place.
#[derive(Clone)]
pub enum SmallList<T> {
    /// Exactly one item.
    One(T),
    /// Any other number (none included: an empty `Vec` takes no allocation).
    Heap(Vec<T>),
}

impl<T> SmallList<T> {
    /// An empty list.
    pub const fn new() -> Self {
        SmallList::Heap(Vec::new())
    }

    /// Appends `item`.
    pub fn push(&mut self, item: T) {
        match self {
            SmallList::Heap(v) if v.is_empty() => *self = SmallList::One(item),
            SmallList::Heap(v) => v.push(item),
            SmallList::One(_) => {
                let SmallList::One(first) = std::mem::take(self) else {
                    unreachable!("matched One above")
                };
                *self = SmallList::Heap(vec![first, item]);
            }
        }
    }

    /// The items as a `Vec`.
    pub fn into_vec(self) -> Vec<T> {
        match self {
            SmallList::One(item) => vec![item],
            SmallList::Heap(v) => v,
        }
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
        match self {
            SmallList::One(item) => std::slice::from_ref(item),
            SmallList::Heap(v) => v,
        }
    }
}

impl<T> DerefMut for SmallList<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            SmallList::One(item) => std::slice::from_mut(item),
            SmallList::Heap(v) => v,
        }
    }
}

impl<T> From<Vec<T>> for SmallList<T> {
    fn from(mut v: Vec<T>) -> Self {
        match v.pop() {
            Some(item) if v.is_empty() => SmallList::One(item),
            Some(item) => {
                v.push(item);
                SmallList::Heap(v)
            }
            None => SmallList::Heap(v),
        }
    }
}

impl<T> FromIterator<T> for SmallList<T> {
    fn from_iter<I: IntoIterator<Item = T>>(items: I) -> Self {
        let mut items = items.into_iter();
        let Some(first) = items.next() else {
            return SmallList::new();
        };
        match items.next() {
            None => SmallList::One(first),
            Some(second) => {
                let mut v = Vec::with_capacity(2 + items.size_hint().0);
                v.push(first);
                v.push(second);
                v.extend(items);
                SmallList::Heap(v)
            }
        }
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
            let collected: SmallList<u32> = (0..n).collect();
            let converted = SmallList::from((0..n).collect::<Vec<_>>());
            let mut pushed = SmallList::new();
            (0..n).for_each(|i| pushed.push(i));
            let want: Vec<u32> = (0..n).collect();
            for list in [&collected, &converted, &pushed] {
                assert_eq!(&**list, &want[..]);
                assert_eq!(matches!(list, SmallList::One(_)), n == 1);
                assert_eq!(list.clone().into_vec(), want);
            }
            assert_eq!(collected, pushed);
        }
    }
}
