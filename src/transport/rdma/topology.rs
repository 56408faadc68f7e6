//! NIC priority matrices: which NICs to prefer for a buffer's location.

use std::collections::HashMap;

use crate::json::Value;

/// Where to prefer which NICs: location → (preferred, other) NIC indices.
#[derive(Clone, Debug, Default)]
pub(super) struct Topology {
    by_location: HashMap<String, (Vec<usize>, Vec<usize>)>,
}

impl Topology {
    /// Parses a priority matrix against a NIC list (names not in it are ignored).
    pub(super) fn parse(matrix: &Value, nics: &[String]) -> Topology {
        let index = |v: &Value| v.as_str().and_then(|n| nics.iter().position(|x| x == n));
        let mut by_location = HashMap::new();
        for (loc, lists) in matrix.as_object().unwrap_or(&[]) {
            let list = |i: usize| -> Vec<usize> {
                lists
                    .as_array()
                    .and_then(|a| a.get(i))
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(index).collect())
                    .unwrap_or_default()
            };
            by_location.insert(loc.clone(), (list(0), list(1)));
        }
        Topology { by_location }
    }

    /// NICs for a buffer at `location`: its preferred list (else `*`'s, else all)
    /// and the other usable ones.
    pub(super) fn nics_for(&self, location: &str, count: usize) -> (Vec<usize>, Vec<usize>) {
        let entry = self
            .by_location
            .get(location)
            .or_else(|| self.by_location.get("*"))
            .filter(|(p, _)| !p.is_empty());
        match entry {
            Some((p, o)) => {
                let mut other: Vec<usize> = o.clone();
                // Every NIC stays usable as a last resort.
                other.extend((0..count).filter(|i| !p.contains(i) && !o.contains(i)));
                (p.clone(), other)
            }
            None => ((0..count).collect(), Vec::new()),
        }
    }

    pub(super) fn to_json(nics: &[String]) -> Value {
        let all: Vec<Value> = nics.iter().map(|n| Value::from(n.as_str())).collect();
        Value::object([(
            "cpu:0",
            Value::Array(vec![Value::Array(all), Value::Array(Vec::new())]),
        )])
    }
}
