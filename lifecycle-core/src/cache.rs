//! Caches that carry the weight version: KV and prefix caches never serve an entry built from
//! other weights.
//!
//! Two tools, for two lifetimes of a cached value:
//!
//! - Within one rollout session: [`RolloutView::brand`] ties a value (a KV handle, a batch's
//!   blocks) to the view's lifetime. A [`Branded`](crate::Branded) value cannot outlive the
//!   session, so keeping it across a training update is a compile error, like keeping the view.
//! - Across rollout calls: a [`VersionedCache`] (a [`PrefixCache`] for token prefixes) lives in
//!   the engine. Every lookup and insertion takes a proof of the current version (a
//!   [`RolloutView`] or a [`Stamp`], both only obtainable from a live session); when the version
//!   differs from the one its entries were built at, the cache is cleared first. So entries are
//!   served within one weight version, across as many calls as it lasts, and never after an update.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;

use crate::view::{RolloutView, Stamp};

mod sealed {
    pub trait Sealed {}
}

/// A proof of the current weight version: implemented only by values borrowed from a live
/// rollout session ([`RolloutView`], [`Stamp`], and references to them), so a cache cannot be
/// handed a stale number. The trait is sealed: a plain `u64` is not a proof.
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError, WeightsVersion};
///
/// /// Code that keys its own state by weight version takes the proof, not a number.
/// fn built_at(at: impl WeightsVersion) -> u64 {
///     at.weights_version()
/// }
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0]);
///     lc.train()?.state_mut()[0] = 2.0;                 // version 1
///     let session = lc.rollout()?;
///     let weights = session.weights();
///     assert_eq!(built_at(weights), 1);
///     assert_eq!(built_at(weights.stamp()), 1);
///     assert_eq!(built_at(&weights), 1);
///     session.finish()
/// }
/// ```
pub trait WeightsVersion: sealed::Sealed {
    /// The version of the weights the session serves.
    fn weights_version(&self) -> u64;
}

impl<W> sealed::Sealed for RolloutView<'_, W> {}

impl<W> WeightsVersion for RolloutView<'_, W> {
    fn weights_version(&self) -> u64 {
        self.version()
    }
}

impl<T: WeightsVersion> sealed::Sealed for &T {}

impl<T: WeightsVersion> WeightsVersion for &T {
    fn weights_version(&self) -> u64 {
        (**self).weights_version()
    }
}

impl sealed::Sealed for Stamp<'_> {}

impl WeightsVersion for Stamp<'_> {
    fn weights_version(&self) -> u64 {
        self.version()
    }
}

/// What a [`VersionedCache`] did so far ([`VersionedCache::stats`]).
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{CacheStats, Lifecycle, LifecycleError, VersionedCache};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0]);
///     let mut cache: VersionedCache<&str, f32> = VersionedCache::new();
///     let session = lc.rollout()?;
///     let w = session.weights();
///     cache.insert(w, "prompt", 0.5);
///     assert!(cache.get(w, "prompt").is_some());
///     assert!(cache.get(w, "other").is_none());
///     session.finish()?;
///     let expected = CacheStats { hits: 1, misses: 1, inserts: 1, ..CacheStats::default() };
///     assert_eq!(cache.stats(), expected);
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups that found an entry of the current version.
    pub hits: u64,
    /// Lookups that found nothing (including those that found only entries of another version).
    pub misses: u64,
    /// Entries inserted.
    pub inserts: u64,
    /// Times the cache found entries of another version and cleared them.
    pub invalidations: u64,
    /// Entries dropped by those invalidations.
    pub invalidated_entries: u64,
}

/// A map whose entries are branded with the weight version they were built at; it lives in an
/// engine across rollout calls.
///
/// Every access takes a [`WeightsVersion`] (the session's [`RolloutView`] or a [`Stamp`]). When
/// it differs from the version of the entries, they are all dropped before the access: an entry
/// is served only to sessions of the version it was built at.
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError, VersionedCache};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0, 2.0]);
///     let mut scores: VersionedCache<String, f32> = VersionedCache::new();
///
///     let session = lc.rollout()?;
///     let w = session.weights();
///     let score = *scores.get_or_insert_with(w, "a prompt".to_string(), || w[0] + w[1]);
///     assert_eq!(score, 3.0);
///     session.finish()?;
///
///     let session = lc.rollout()?;                          // same version: served
///     assert_eq!(scores.get(session.weights(), "a prompt"), Some(&3.0));
///     session.finish()?;
///
///     lc.train()?.state_mut()[0] = 5.0;                    // a training update
///     let session = lc.rollout()?;                          // new version: never served
///     assert_eq!(scores.get(session.weights(), "a prompt"), None);
///     assert_eq!(scores.stats().invalidations, 1);
///     session.finish()
/// }
/// ```
pub struct VersionedCache<K, V> {
    version: Option<u64>,
    entries: HashMap<K, V>,
    stats: CacheStats,
}

/// A [`VersionedCache`] keyed by token sequences, with
/// [`longest_prefix`](VersionedCache::longest_prefix) lookups: the KV of a prompt's longest
/// cached prefix, built at the current weight version.
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError, PrefixCache};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0, 2.0]);
///     let mut prefixes: PrefixCache<u32, f32> = PrefixCache::new();
///
///     let session = lc.rollout()?;
///     let w = session.weights();
///     prefixes.insert(w, vec![7, 8], w[0] + w[1]);         // KV of the prefix [7, 8]
///     assert_eq!(prefixes.longest_prefix(w, &[7, 8, 9]), Some((2, &3.0)));
///     assert_eq!(prefixes.longest_prefix(w, &[9]), None);
///     session.finish()?;
///
///     lc.train()?.state_mut()[0] = 5.0;                    // a training update
///     let session = lc.rollout()?;                          // new version: never served
///     assert_eq!(prefixes.longest_prefix(session.weights(), &[7, 8, 9]), None);
///     session.finish()
/// }
/// ```
pub type PrefixCache<T, V> = VersionedCache<Vec<T>, V>;

impl<K, V> Default for VersionedCache<K, V> {
    fn default() -> Self {
        VersionedCache {
            version: None,
            entries: HashMap::new(),
            stats: CacheStats::default(),
        }
    }
}

impl<K, V> VersionedCache<K, V> {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// The version the entries were built at; `None` before the first access.
    pub fn version(&self) -> Option<u64> {
        self.version
    }

    /// How many entries are stored (of [`version`](VersionedCache::version)).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is stored.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// What the cache did so far.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// The stored values, whatever their version (for memory accounting, not for serving).
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.entries.values()
    }

    /// Drops every entry (for example when the engine sleeps and frees the memory they point to).
    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

impl<K: Eq + Hash, V> VersionedCache<K, V> {
    /// Drops the entries when `at` is another version than theirs.
    fn sync(&mut self, at: &impl WeightsVersion) {
        let version = at.weights_version();
        if self.version != Some(version) {
            if !self.entries.is_empty() {
                self.stats.invalidations += 1;
                self.stats.invalidated_entries += self.entries.len() as u64;
                self.entries.clear();
            }
            self.version = Some(version);
        }
    }

    /// The entry for `key` built at the version of `at`.
    pub fn get<Q>(&mut self, at: impl WeightsVersion, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.sync(&at);
        let found = self.entries.get(key);
        match found {
            Some(_) => self.stats.hits += 1,
            None => self.stats.misses += 1,
        }
        found
    }

    /// The entry for `key` built at the version of `at`, mutable.
    pub fn get_mut<Q>(&mut self, at: impl WeightsVersion, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.sync(&at);
        let found = self.entries.get_mut(key);
        match found {
            Some(_) => self.stats.hits += 1,
            None => self.stats.misses += 1,
        }
        found
    }

    /// Stores `value` for `key`, built at the version of `at`; returns the entry it replaces (of
    /// the same version).
    pub fn insert(&mut self, at: impl WeightsVersion, key: K, value: V) -> Option<V> {
        self.sync(&at);
        self.stats.inserts += 1;
        self.entries.insert(key, value)
    }

    /// The entry for `key` at the version of `at`, built with `make` when missing.
    pub fn get_or_insert_with(
        &mut self,
        at: impl WeightsVersion,
        key: K,
        make: impl FnOnce() -> V,
    ) -> &mut V {
        self.sync(&at);
        match self.entries.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => {
                self.stats.hits += 1;
                e.into_mut()
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                self.stats.misses += 1;
                self.stats.inserts += 1;
                e.insert(make())
            }
        }
    }

    /// Removes the entry for `key` (of the version of `at`).
    pub fn remove<Q>(&mut self, at: impl WeightsVersion, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.sync(&at);
        self.entries.remove(key)
    }
}

impl<T: Eq + Hash, V> VersionedCache<Vec<T>, V> {
    /// The longest stored prefix of `tokens` built at the version of `at`, with its length.
    pub fn longest_prefix(&mut self, at: impl WeightsVersion, tokens: &[T]) -> Option<(usize, &V)> {
        self.sync(&at);
        let len = (1..=tokens.len())
            .rev()
            .find(|&n| self.entries.contains_key(&tokens[..n]));
        match len {
            Some(n) => {
                self.stats.hits += 1;
                self.entries.get(&tokens[..n]).map(|v| (n, v))
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }
}

impl<K, V> fmt::Debug for VersionedCache<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VersionedCache")
            .field("version", &self.version)
            .field("len", &self.entries.len())
            .field("stats", &self.stats)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(version: u64) -> Stamp<'static> {
        Stamp::new(version)
    }

    #[test]
    fn entries_are_served_within_their_version_only() {
        let mut cache: PrefixCache<u32, &str> = PrefixCache::new();
        assert_eq!(cache.insert(at(3), vec![1, 2], "kv12"), None);
        cache.insert(at(3), vec![1], "kv1");
        for _ in 0..3 {
            assert_eq!(cache.longest_prefix(at(3), &[1, 2, 5]), Some((2, &"kv12")));
        }
        assert_eq!(cache.longest_prefix(at(3), &[2]), None);
        assert_eq!(cache.get(at(4), &[1, 2][..]), None);
        assert!(cache.is_empty());
        assert_eq!(cache.version(), Some(4));
        // Going back to an old version does not resurrect anything either.
        assert_eq!(cache.get(at(3), &[1][..]), None);
        let stats = cache.stats();
        assert_eq!((stats.hits, stats.misses, stats.inserts), (3, 3, 2));
        assert_eq!((stats.invalidations, stats.invalidated_entries), (1, 2));
    }

    #[test]
    fn get_or_insert_builds_once_per_version() {
        let mut cache: VersionedCache<&str, u32> = VersionedCache::new();
        let mut built = 0;
        for version in [0, 0, 0, 1, 1] {
            let v = cache.get_or_insert_with(at(version), "p", || {
                built += 1;
                version as u32
            });
            assert_eq!(*v, version as u32);
        }
        assert_eq!(built, 2);
        *cache.get_mut(at(1), "p").expect("stored at 1") += 10;
        assert_eq!(cache.remove(at(1), "p"), Some(11));
    }
}
