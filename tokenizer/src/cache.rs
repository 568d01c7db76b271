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
//!
//! A key is hashed once per operation ([`GenerationalMap::hash`]; the same
//! hash finds it in both generations and stores it), and the tables hold
//! keys and values inline ([`CacheKey`]), so a hit reads one bucket.

use std::hash::{BuildHasher, Hash};

use hashbrown::HashTable;

/// A value with a cost in bytes.
pub(crate) trait Cost {
    /// Bytes it takes, bookkeeping included.
    fn cost(&self) -> usize;
}

/// A key of a [`GenerationalMap`], looked up by a borrowed form.
pub(crate) trait CacheKey {
    /// What lookups pass (`[u8]` for a word, the digest for a segment).
    type Borrowed: ?Sized + Hash + Eq;
    /// The borrowed form (hashed and compared).
    fn borrowed(&self) -> &Self::Borrowed;
}

impl CacheKey for u128 {
    type Borrowed = u128;
    fn borrowed(&self) -> &u128 {
        self
    }
}

/// A two-generation bounded map (see the module docs).
#[derive(Debug)]
pub(crate) struct GenerationalMap<K, V, S> {
    current: HashTable<(K, V)>,
    previous: HashTable<(K, V)>,
    hasher: S,
    current_bytes: usize,
    previous_bytes: usize,
    /// Half the budget: the most one generation holds.
    generation_bytes: usize,
}

impl<K: CacheKey, V: Cost, S: BuildHasher> GenerationalMap<K, V, S> {
    /// An empty map of at most `budget_bytes`.
    pub(crate) fn new(budget_bytes: usize, hasher: S) -> Self {
        Self {
            current: HashTable::new(),
            previous: HashTable::new(),
            hasher,
            current_bytes: 0,
            previous_bytes: 0,
            generation_bytes: budget_bytes / 2,
        }
    }

    /// The hash `key` is found and stored under.
    pub(crate) fn hash(&self, key: &K::Borrowed) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The value of `key` (whose [`hash`](Self::hash) is `hash`), moved
    /// into the current generation if it was in the previous one.
    pub(crate) fn get(&mut self, hash: u64, key: &K::Borrowed) -> Option<&V> {
        let eq = |(k, _): &(K, V)| k.borrowed() == key;
        if let Some(index) = self.current.find_bucket_index(hash, eq) {
            return self.current.get_bucket(index).map(|(_, v)| v);
        }
        let ((key, value), _) = self.previous.find_entry(hash, eq).ok()?.remove();
        let cost = value.cost();
        self.previous_bytes -= cost;
        self.make_room(cost);
        self.current_bytes += cost;
        let hasher = &self.hasher;
        let entry = self
            .current
            .insert_unique(hash, (key, value), |(k, _)| hasher.hash_one(k.borrowed()));
        Some(&entry.into_mut().1)
    }

    /// Stores `value` under `key` (whose [`hash`](Self::hash) is `hash`;
    /// nothing if it alone exceeds a generation's share of the budget).
    pub(crate) fn insert(&mut self, hash: u64, key: K, value: V) {
        let cost = value.cost();
        if cost > self.generation_bytes {
            return;
        }
        self.make_room(cost);
        let hasher = &self.hasher;
        match self.current.entry(
            hash,
            |(k, _)| k.borrowed() == key.borrowed(),
            |(k, _)| hasher.hash_one(k.borrowed()),
        ) {
            hashbrown::hash_table::Entry::Occupied(mut o) => {
                let old = std::mem::replace(&mut o.get_mut().1, value);
                self.current_bytes -= old.cost();
            }
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert((key, value));
            }
        }
        self.current_bytes += cost;
    }

    /// Starts a new generation if `cost` more bytes would not fit.
    fn make_room(&mut self, cost: usize) {
        if self.current_bytes + cost > self.generation_bytes {
            self.previous = std::mem::replace(&mut self.current, HashTable::new());
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

    fn map(budget: usize) -> GenerationalMap<u128, Vec<u8>, foldhash::fast::FixedState> {
        GenerationalMap::new(budget, foldhash::fast::FixedState::default())
    }

    /// `get` with the key hashed as callers do.
    fn get(m: &mut GenerationalMap<u128, Vec<u8>, foldhash::fast::FixedState>, k: u128) -> Option<&Vec<u8>> {
        m.get(m.hash(&k), &k)
    }

    fn insert(m: &mut GenerationalMap<u128, Vec<u8>, foldhash::fast::FixedState>, k: u128, v: Vec<u8>) {
        m.insert(m.hash(&k), k, v)
    }

    #[test]
    fn stays_within_budget_and_keeps_what_is_used() {
        let mut m = map(1000);
        for k in 0..100u128 {
            insert(&mut m, k, vec![0; 30]);
            // Key 0 is used all the time: it survives every rotation.
            assert!(get(&mut m, 0).is_some(), "after {k}");
            assert!(m.bytes() <= 1000, "{}", m.bytes());
        }
        assert!(get(&mut m, 1).is_none(), "an unused old entry was evicted");
        assert!(get(&mut m, 99).is_some());
        assert!(m.len() < 100);
    }

    #[test]
    fn oversized_values_are_not_kept_and_replacing_accounts_once() {
        let mut m = map(100);
        insert(&mut m, 1, vec![0; 51]);
        assert!(get(&mut m, 1).is_none());
        insert(&mut m, 2, vec![0; 10]);
        insert(&mut m, 2, vec![0; 20]);
        assert_eq!(m.bytes(), 20);
        assert_eq!(m.len(), 1);
        assert_eq!(m.budget(), 100);
    }
}
