//! The KV cache's page tables on the host: which page of the cache holds each
//! [`KV_PAGE_POSITIONS`] positions of each sequence, per replica, uploaded to every rank of the
//! replica before the next pass that reads them (the kernels' `kv_at`).
//!
//! Two kinds of cache use them:
//! - a cache grown per call (a static batch of `n` sequences of [`GpuDecoder`](crate::GpuDecoder)):
//!   sequence `s`'s page `j` is page `j · n + s`, so growing the cache appends pages to each layer
//!   block and keeps every page where it was;
//! - a fixed cache of `budget` pages per replica (the engine's, allocated at wake): the
//!   continuous scheduler maps each admitted sequence's pages ([`PageTables::set_row`]), a
//!   group's samples sharing their prompt's full pages; one more page and one more row take the
//!   padding rows of a decode step, which never touch a sequence's pages. A static call on it
//!   splits the pages evenly over its sequences ([`PageTables::split`]).

/// Positions of one KV cache page (the kernels' `KV_PAGE`).
pub const KV_PAGE_POSITIONS: usize = 64;

/// One cache's page tables (see [the module](self)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PageTables {
    /// Pages a table row names: a sequence holds at most `pps · KV_PAGE_POSITIONS` positions.
    pub pps: usize,
    /// Rows of a table (the padding row last in a fixed cache).
    pub rows: usize,
    /// Pages of one layer block of the cache (the padding page last in a fixed cache).
    pub pages: usize,
    /// A fixed cache: pages `0..pages - 1` are the sequences', row `rows - 1` and page
    /// `pages - 1` the padding's.
    pub fixed: bool,
    /// Per replica, its table `[rows][pps]`.
    pub tables: Vec<Vec<u32>>,
    /// Changed since the ranks last received them.
    pub dirty: bool,
}

impl PageTables {
    /// The tables of a cache grown per call: replica `r`'s `slots[r]` sequences of up to
    /// `positions` each, sequence `s`'s page `j` at `j · n + s` with `n` the most sequences of a
    /// replica (the cache's layout is the same on every replica).
    pub fn grow(slots: &[usize], positions: usize) -> Self {
        let pps = positions.div_ceil(KV_PAGE_POSITIONS);
        let n = slots.iter().copied().max().unwrap_or(0);
        let table: Vec<u32> = (0..n)
            .flat_map(|s| (0..pps).map(move |j| (j * n + s) as u32))
            .collect();
        PageTables {
            pps,
            rows: n,
            pages: n * pps,
            fixed: false,
            tables: vec![table; slots.len()],
            dirty: true,
        }
    }

    /// The tables of a fixed cache of `budget` pages per replica for `slots` sequences per
    /// replica of up to `positions` each: every row at the padding page until it is mapped.
    pub fn fixed(replicas: usize, slots: usize, positions: usize, budget: usize) -> Self {
        let pps = positions.div_ceil(KV_PAGE_POSITIONS);
        let rows = slots + 1;
        PageTables {
            pps,
            rows,
            pages: budget + 1,
            fixed: true,
            tables: vec![vec![budget as u32; rows * pps]; replicas],
            dirty: true,
        }
    }

    /// Positions a row holds.
    pub fn positions(&self) -> usize {
        self.pps * KV_PAGE_POSITIONS
    }

    /// Pages of a fixed cache that sequences may hold (the padding page not counted).
    pub fn budget(&self) -> usize {
        if self.fixed {
            self.pages.saturating_sub(1)
        } else {
            self.pages
        }
    }

    /// The row padding rows of a decode step read and write (a fixed cache's last).
    pub fn padding_row(&self) -> usize {
        self.rows.saturating_sub(1)
    }

    /// Maps row `row` of replica `replica` to `pages` (its first pages; the rest of the row at
    /// the padding page). Checked: a page past the budget, or more pages than a row holds.
    pub fn set_row(&mut self, replica: usize, row: usize, pages: &[u32]) -> Result<(), String> {
        let (pps, budget, padding) = (self.pps, self.budget(), self.pages.saturating_sub(1));
        if !self.fixed || row + 1 >= self.rows || pages.len() > pps {
            return Err(format!(
                "a page table row {row} of {} pages for a cache of {} rows of {pps} pages",
                pages.len(),
                self.rows.saturating_sub(1)
            ));
        }
        if let Some(&p) = pages.iter().find(|&&p| p as usize >= budget) {
            return Err(format!(
                "page {p} of row {row}: the cache holds {budget} pages"
            ));
        }
        let table = self
            .tables
            .get_mut(replica)
            .ok_or_else(|| format!("no page table for replica {replica}"))?;
        let at = &mut table[row * pps..(row + 1) * pps];
        at[..pages.len()].copy_from_slice(pages);
        at[pages.len()..].fill(padding as u32);
        self.dirty = true;
        Ok(())
    }

    /// Positions row `row` of replica `replica` holds: its mapped pages' (every page of a grown
    /// cache's rows).
    pub fn room(&self, replica: usize, row: usize) -> usize {
        let Some(table) = self.tables.get(replica) else {
            return 0;
        };
        if !self.fixed {
            return if row < self.rows { self.positions() } else { 0 };
        }
        let padding = self.pages.saturating_sub(1) as u32;
        let mapped = table
            .get(row * self.pps..(row + 1) * self.pps)
            .map_or(0, |r| r.iter().take_while(|&&p| p != padding).count());
        mapped * KV_PAGE_POSITIONS
    }

    /// A static call on a fixed cache: the pages split evenly over the `counts[r]` sequences of
    /// each replica (sequence `s`'s page `j` at `j · n + s`); the positions each then holds.
    pub fn split(&mut self, counts: &[usize]) -> usize {
        let (pps, budget) = (self.pps, self.budget());
        let n = counts.iter().copied().max().unwrap_or(0).max(1);
        let each = (budget / n).min(pps);
        let padding = self.pages.saturating_sub(1) as u32;
        for table in &mut self.tables {
            table.fill(padding);
            for s in 0..n.min(self.rows.saturating_sub(1)) {
                for j in 0..each {
                    table[s * pps + j] = (j * n + s) as u32;
                }
            }
        }
        self.dirty = true;
        each * KV_PAGE_POSITIONS
    }

    /// The page copies of replica `replica`'s forks (`[leader, row, length]` each): every page
    /// of a fork's first `length` positions that its row does not share with its leader's, as
    /// `[from, to]` pairs.
    pub fn fork_copies(&self, replica: usize, forks: &[u32]) -> Vec<u32> {
        let Some(table) = self.tables.get(replica) else {
            return Vec::new();
        };
        let pps = self.pps;
        let mut out = Vec::new();
        for f in forks.chunks_exact(3) {
            let (leader, row, len) = (f[0] as usize, f[1] as usize, f[2] as usize);
            for j in 0..len.div_ceil(KV_PAGE_POSITIONS).min(pps) {
                let (from, to) = (table[leader * pps + j], table[row * pps + j]);
                if from != to {
                    out.extend([from, to]);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grown_cache_keeps_every_page_where_it_was() {
        let small = PageTables::grow(&[3, 2], 100);
        let large = PageTables::grow(&[3, 2], 300);
        assert_eq!((small.pps, small.rows, small.pages), (2, 3, 6));
        assert_eq!((large.pps, large.pages), (5, 15));
        for s in 0..3 {
            for j in 0..2 {
                assert_eq!(small.tables[0][s * 2 + j], large.tables[0][s * 5 + j]);
            }
        }
        // every page of a replica's rows is distinct
        let mut seen = large.tables[0].clone();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 15);
    }

    #[test]
    fn a_fixed_cache_maps_rows_and_pads_the_rest() {
        let mut t = PageTables::fixed(2, 4, 200, 10);
        assert_eq!(
            (t.pps, t.rows, t.pages, t.budget(), t.padding_row()),
            (4, 5, 11, 10, 4)
        );
        assert!(t.tables.iter().all(|r| r.iter().all(|&p| p == 10)));
        t.set_row(1, 2, &[7, 3]).unwrap();
        assert_eq!(&t.tables[1][8..12], &[7, 3, 10, 10]);
        assert_eq!((t.room(1, 2), t.room(0, 2)), (2 * KV_PAGE_POSITIONS, 0));
        assert_eq!(&t.tables[0][8..12], &[10; 4]);
        assert!(t.set_row(0, 4, &[1]).unwrap_err().contains("row 4"));
        assert!(t.set_row(0, 0, &[10]).unwrap_err().contains("10 pages"));
        assert!(t.set_row(0, 0, &[0; 5]).is_err());
    }

    #[test]
    fn forks_copy_only_the_pages_they_do_not_share() {
        let mut t = PageTables::fixed(1, 3, 256, 12);
        t.set_row(0, 0, &[0, 1, 2]).unwrap();
        // row 1 shares the two full pages of a 150-position prompt, not the partial third
        t.set_row(0, 1, &[0, 1, 5, 6]).unwrap();
        assert_eq!(t.fork_copies(0, &[0, 1, 150]), vec![2, 5]);
        // a row sharing nothing copies every page the prompt touches
        t.set_row(0, 2, &[8, 9, 10]).unwrap();
        assert_eq!(t.fork_copies(0, &[0, 2, 128]), vec![0, 8, 1, 9]);
        // a grown cache's rows share nothing
        let g = PageTables::grow(&[2], 128);
        assert_eq!(g.fork_copies(0, &[0, 1, 65]), vec![0, 1, 2, 3]);
    }

    #[test]
    fn a_static_call_splits_the_fixed_pages_evenly() {
        let mut t = PageTables::fixed(1, 4, 512, 10);
        // 3 sequences: 3 pages each (of 8 a row holds)
        assert_eq!(t.split(&[3]), 3 * KV_PAGE_POSITIONS);
        let used: Vec<u32> = t.tables[0].iter().copied().filter(|&p| p != 10).collect();
        let mut distinct = used.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!((used.len(), distinct.len()), (9, 9));
        assert!(used.iter().all(|&p| p < 10));
    }
}
