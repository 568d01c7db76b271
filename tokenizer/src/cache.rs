//! A bounded map for the tokenizer's caches (words, segments): two
//! generations, so memory stays within a budget and what is used survives.
//!
//! Entries go into the *current* generation. When it would exceed half the
//! budget, it becomes the *previous* one (the old previous is dropped) and
//! a new current starts. A hit in the previous generation moves the entry
//! back into the current one. So at most the whole budget is held, every
//! operation is O(1), and an entry used at least once per half-budget of
//! insertions is never evicted (a cheap approximation of LRU, as in
//! "2Q"/generational caches).

use std::hash::{BuildHasher, Hash};

use hashbrown::HashMap;

/// A value with a cost in bytes.
pub(crate) trait Cost {
    /// Bytes it takes, bookkeeping included.
    fn cost(&self) -> usize;
}

/// A two-generation bounded map (see the module docs).
#[derive(Debug)]
pub(crate) struct GenerationalMap<K, V, S> {
    current: HashMap<K, V, S>,
    previous: HashMap<K, V, S>,
    current_bytes: usize,
    previous_bytes: usize,
    /// Half the budget: the most one generation holds.
    generation_bytes: usize,
}

impl<K: Hash + Eq, V: Cost, S: BuildHasher + Clone> GenerationalMap<K, V, S> {
    /// An empty map of at most `budget_bytes`.
    pub(crate) fn new(budget_bytes: usize, hasher: S) -> Self {
        Self {
            current: HashMap::with_hasher(hasher.clone()),
            previous: HashMap::with_hasher(hasher),
            current_bytes: 0,
            previous_bytes: 0,
            generation_bytes: budget_bytes / 2,
        }
    }

    /// The value of `key`, moved into the current generation if it was in
    /// the previous one.
    pub(crate) fn get<Q>(&mut self, key: &Q) -> Option<&V>
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if self.current.contains_key(key) {
            return self.current.get(key);
        }
        let (key, value) = self.previous.remove_entry(key)?;
        let cost = value.cost();
        self.previous_bytes -= cost;
        self.make_room(cost);
        self.current_bytes += cost;
        Some(self.current.entry(key).or_insert(value))
    }

    /// Stores `value` under `key` (nothing if it alone exceeds a
    /// generation's share of the budget).
    pub(crate) fn insert(&mut self, key: K, value: V) {
        let cost = value.cost();
        if cost > self.generation_bytes {
            return;
        }
        self.make_room(cost);
        if let Some(old) = self.current.insert(key, value) {
            self.current_bytes -= old.cost();
        }
        self.current_bytes += cost;
    }

    /// Starts a new generation if `cost` more bytes would not fit.
    fn make_room(&mut self, cost: usize) {
        if self.current_bytes + cost > self.generation_bytes {
            self.previous = std::mem::replace(&mut self.current, HashMap::with_hasher(self.previous.hasher().clone()));
            self.previous_bytes = std::mem::take(&mut self.current_bytes);
        }
    }

    /// Entries held.
    pub(crate) fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.current_bytes + self.previous_bytes
    }

    /// The budget.
    pub(crate) fn budget(&self) -> usize {
        self.generation_bytes * 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Cost for Vec<u8> {
        fn cost(&self) -> usize {
            self.len()
        }
    }

    fn map(budget: usize) -> GenerationalMap<u32, Vec<u8>, foldhash::fast::FixedState> {
        GenerationalMap::new(budget, foldhash::fast::FixedState::default())
    }

    #[test]
    fn stays_within_budget_and_keeps_what_is_used() {
        let mut m = map(1000);
        for k in 0..100u32 {
            m.insert(k, vec![0; 30]);
            // Key 0 is used all the time: it survives every rotation.
            assert!(m.get(&0).is_some(), "after {k}");
            assert!(m.bytes() <= 1000, "{}", m.bytes());
        }
        assert!(m.get(&1).is_none(), "an unused old entry was evicted");
        assert!(m.get(&99).is_some());
        assert!(m.len() < 100);
    }

    #[test]
    fn oversized_values_are_not_kept_and_replacing_accounts_once() {
        let mut m = map(100);
        m.insert(1, vec![0; 51]);
        assert!(m.get(&1).is_none());
        m.insert(2, vec![0; 10]);
        m.insert(2, vec![0; 20]);
        assert_eq!(m.bytes(), 20);
        assert_eq!(m.len(), 1);
        assert_eq!(m.budget(), 100);
    }
}
