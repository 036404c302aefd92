//! The KV pages of a paged decoder as the [`Scheduler`](super::scheduler::Scheduler) reserves
//! them: [`KvPaging`] says how a decoder's cache is paged, [`KvPages`] is the scheduler's ledger
//! of which pages each running slot holds.
//!
//! The policy is to reserve at admission: a request is admitted only when the pages for its
//! prompt and every token it may sample are free in its slot's group, and holds them until it
//! finishes, is aborted or preempted; so no step ever runs out of room, and nothing is
//! preempted for room. Requests are admitted in order: while the first queued request does not
//! fit, none behind it is admitted (so a long request is never starved by short ones).
//!
//! Samples of one prompt admitted together share its full pages: a request whose context equals
//! that of a request admitted earlier in the same step, in the same group, holds that request's
//! `⌊len / page⌋` full pages (counted once) and pages of its own for the rest, the partial page
//! included (the decoder copies it from the leader: copy on write, done at the fork since both
//! write their next positions into it).

/// How a decoder's KV cache is paged ([`SlotDecoder::paging`](super::scheduler::SlotDecoder::paging)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvPaging {
    /// Positions of one page.
    pub page_positions: usize,
    /// Pages each group of slots shares (one data-parallel replica's cache).
    pub pages_per_group: usize,
    /// Slots of a group: slot `s` lies in group `s / slots_per_group`.
    pub slots_per_group: usize,
}

impl KvPaging {
    /// Pages that hold `positions` positions.
    pub fn pages_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.page_positions.max(1))
    }
}

/// The scheduler's ledger of a paged decoder's pages (see [the module](self)).
///
/// ```
/// use lifecycle_decoder::{KvPages, KvPaging};
/// let paging = KvPaging { page_positions: 16, pages_per_group: 8, slots_per_group: 4 };
/// let mut pages = KvPages::new(paging, 4);
/// // a 20-token prompt + 12 new tokens: 2 pages
/// assert_eq!(pages.hold(0, 32, None), Some(&[0, 1][..]));
/// // a sample of the same prompt shares its full page and holds 1 of its own
/// assert_eq!(pages.hold(1, 32, Some((0, 20))), Some(&[0, 2][..]));
/// assert_eq!(pages.free(0), 5);
/// // 6 pages do not fit the 5 free: nothing is held
/// assert_eq!(pages.hold(2, 96, None), None);
/// pages.release(0);
/// assert_eq!(pages.free(0), 6); // page 0 is still the sample's
/// # Ok::<(), lifecycle_decoder::DecodeError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvPages {
    paging: KvPaging,
    /// Per group, its free pages, the lowest last (taken first).
    free: Vec<Vec<u32>>,
    /// Per group and page, how many slots hold it.
    refs: Vec<Vec<u32>>,
    /// Per slot, the pages it holds in order.
    held: Vec<Vec<u32>>,
}

impl KvPages {
    /// Every page of `paging` free, for `slots` slots.
    pub fn new(paging: KvPaging, slots: usize) -> Self {
        let groups = slots.div_ceil(paging.slots_per_group.max(1));
        let all: Vec<u32> = (0..paging.pages_per_group as u32).rev().collect();
        KvPages {
            paging,
            free: vec![all; groups],
            refs: vec![vec![0; paging.pages_per_group]; groups],
            held: vec![Vec::new(); slots],
        }
    }

    /// How the cache is paged.
    pub fn paging(&self) -> KvPaging {
        self.paging
    }

    /// The group of slot `slot`.
    pub fn group(&self, slot: usize) -> usize {
        slot / self.paging.slots_per_group.max(1)
    }

    /// Free pages of group `group`.
    pub fn free(&self, group: usize) -> usize {
        self.free.get(group).map_or(0, Vec::len)
    }

    /// The pages slot `slot` holds, in order of its positions.
    pub fn table(&self, slot: usize) -> &[u32] {
        self.held.get(slot).map_or(&[], Vec::as_slice)
    }

    /// Makes slot `slot` (holding nothing) hold the pages of `positions` positions: with
    /// `share = Some((leader, len))`, the full pages of the leader's first `len` positions
    /// (the same group's), and free pages for the rest. `None`, with nothing held, when the
    /// free pages are too few (or the slot already holds pages, or the leader is not of its
    /// group).
    pub fn hold(
        &mut self,
        slot: usize,
        positions: usize,
        share: Option<(usize, usize)>,
    ) -> Option<&[u32]> {
        let g = self.group(slot);
        if !self.held.get(slot)?.is_empty() || g >= self.free.len() {
            return None;
        }
        let shared: Vec<u32> = match share {
            Some((leader, len)) if self.group(leader) == g => {
                let full = (len / self.paging.page_positions.max(1)).min(self.table(leader).len());
                self.table(leader)[..full].to_vec()
            }
            Some(_) => return None,
            None => Vec::new(),
        };
        let need = self
            .paging
            .pages_for(positions)
            .saturating_sub(shared.len());
        if need > self.free[g].len() {
            return None;
        }
        let keep = self.free[g].len() - need;
        let own: Vec<u32> = self.free[g].drain(keep..).rev().collect();
        let pages: Vec<u32> = shared.into_iter().chain(own).collect();
        for &p in &pages {
            self.refs[g][p as usize] += 1;
        }
        self.held[slot] = pages;
        Some(&self.held[slot])
    }

    /// Gives back every page slot `slot` holds (a page shared with another slot stays that
    /// slot's).
    pub fn release(&mut self, slot: usize) {
        let g = self.group(slot);
        let Some(pages) = self.held.get_mut(slot).map(std::mem::take) else {
            return;
        };
        for p in pages {
            let r = &mut self.refs[g][p as usize];
            *r -= 1;
            if *r == 0 {
                self.free[g].push(p);
            }
        }
        // the lowest free page is taken first, whatever order pages came back in
        self.free[g].sort_unstable_by(|a, b| b.cmp(a));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paging() -> KvPaging {
        KvPaging {
            page_positions: 4,
            pages_per_group: 6,
            slots_per_group: 2,
        }
    }

    #[test]
    fn shared_pages_are_freed_by_their_last_holder() {
        let mut p = KvPages::new(paging(), 4);
        assert_eq!(p.hold(0, 10, None), Some(&[0, 1, 2][..]));
        // 9 positions shared: 2 full pages, then 1 own
        assert_eq!(p.hold(1, 11, Some((0, 9))), Some(&[0, 1, 3][..]));
        assert_eq!(p.free(0), 2);
        p.release(0);
        assert_eq!((p.free(0), p.table(0)), (3, &[][..]));
        p.release(1);
        assert_eq!(p.free(0), 6);
        // the lowest pages come first again
        assert_eq!(p.hold(0, 4, None), Some(&[0][..]));
    }

    #[test]
    fn groups_keep_their_own_pages() {
        let mut p = KvPages::new(paging(), 4);
        assert_eq!(p.hold(2, 24, None), Some(&[0, 1, 2, 3, 4, 5][..]));
        assert_eq!((p.free(0), p.free(1)), (6, 0));
        assert_eq!(p.hold(3, 1, None), None);
        // a leader of another group shares nothing
        assert_eq!(p.hold(0, 8, Some((2, 8))), None);
        assert_eq!(p.hold(0, 8, None), Some(&[0, 1][..]));
        // a slot holding pages holds no more
        assert_eq!(p.hold(0, 4, None), None);
    }
}
