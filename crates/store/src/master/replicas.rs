//! An object's replicas, sized for the common case: one replica in one piece sits
//! inline in the object (no allocation); several replicas, or a striped one, spill to
//! a list. Either way dropping a replica gives its space back (`PieceAlloc`).

use super::segments::{PieceAlloc, ReplicaAlloc};
use crate::codec::Writer;
use crate::protocol::{encode_replicas_of, ReplicaDesc};

pub(super) enum Replicas {
    /// One replica of one piece.
    One(PieceAlloc),
    /// Any other number of replicas (none included) or pieces.
    Many(Vec<ReplicaAlloc>),
}

impl Default for Replicas {
    fn default() -> Self {
        Replicas::Many(Vec::new())
    }
}

impl From<Vec<ReplicaAlloc>> for Replicas {
    fn from(mut list: Vec<ReplicaAlloc>) -> Self {
        if list.len() == 1 && list[0].len() == 1 {
            if let Some(piece) = list.pop().and_then(|mut r| r.pop()) {
                return Replicas::One(piece);
            }
        }
        Replicas::Many(list)
    }
}

impl Replicas {
    pub fn is_empty(&self) -> bool {
        matches!(self, Replicas::Many(v) if v.is_empty())
    }

    pub fn len(&self) -> usize {
        match self {
            Replicas::One(_) => 1,
            Replicas::Many(v) => v.len(),
        }
    }

    /// Each replica's pieces.
    pub fn iter(&self) -> impl Iterator<Item = &[PieceAlloc]> {
        let (one, many) = match self {
            Replicas::One(p) => (Some(std::slice::from_ref(p)), &[][..]),
            Replicas::Many(v) => (None, &v[..]),
        };
        one.into_iter().chain(many.iter().map(Vec::as_slice))
    }

    /// Every piece of every replica.
    pub fn pieces(&self) -> impl Iterator<Item = &PieceAlloc> {
        self.iter().flatten()
    }

    pub fn push(&mut self, replica: ReplicaAlloc) {
        let mut list = self.take_list();
        list.push(replica);
        *self = Replicas::from(list);
    }

    /// Keeps the replicas `keep` approves; the others' space goes.
    pub fn retain(&mut self, mut keep: impl FnMut(&[PieceAlloc]) -> bool) {
        let mut list = self.take_list();
        list.retain(|r| keep(r));
        *self = Replicas::from(list);
    }

    /// Takes out the first replica `pick` approves.
    pub fn take_where(
        &mut self,
        mut pick: impl FnMut(&[PieceAlloc]) -> bool,
    ) -> Option<ReplicaAlloc> {
        let mut list = self.take_list();
        let taken = list
            .iter()
            .position(|r| pick(r))
            .map(|i| list.swap_remove(i));
        *self = Replicas::from(list);
        taken
    }

    pub fn clear(&mut self) {
        *self = Replicas::default();
    }

    pub fn describe<C: FromIterator<ReplicaDesc>>(&self) -> C {
        self.iter()
            .map(|r| ReplicaDesc {
                pieces: r.iter().map(PieceAlloc::piece).collect(),
            })
            .collect()
    }

    /// Writes the replicas as a descriptor lists them (what `describe` encodes to),
    /// building nothing on the way.
    pub fn encode(&self, w: &mut Writer) {
        match self {
            Replicas::One(p) => encode_replicas_of(w, &[std::slice::from_ref(p)], PieceAlloc::wire),
            Replicas::Many(v) => encode_replicas_of(w, v, PieceAlloc::wire),
        }
    }

    /// The replicas as a list, leaving none here.
    pub fn take_list(&mut self) -> Vec<ReplicaAlloc> {
        match std::mem::take(self) {
            Replicas::One(p) => vec![vec![p]],
            Replicas::Many(v) => v,
        }
    }
}
