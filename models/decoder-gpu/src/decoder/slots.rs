//! Continuous batching on the device: the [`Core`]'s fixed, paged KV cache as slots that requests
//! are prefilled into and fed one token at a time ([`lifecycle_decoder::SlotDecoder`]'s calls),
//! each slot's pages mapped by the scheduler before its prefill ([`Core::map_pages`]).
//!
//! Slot `s` lives on replica `s / slots_per_replica` in its page-table row `s %
//! slots_per_replica`. A decode step's rows are padded up to a bucket size ([`bucket`]) so that
//! CUDA graphs are captured for a few sizes, not for every count of running requests; a padding
//! row reads and writes position 0 of the padding row, whose page no sequence holds, and its pick
//! is greedy and dropped.

use lifecycle_cuda::ThreadRankPool;
use lifecycle_decoder::{DecodeError, Picked};

use super::core::{Core, KvMode};
use super::forward::{Pick, RowPick, Step, StepOut};
use crate::error::GpuDecodeError;
use crate::prefill::PrefillRows;

/// The row count a decode step of `n` rows runs at: powers of two up to 16, then multiples of
/// 16, at most `slots` (a replica's slots; when every slot runs there is no free one to pad
/// into, and no padding is needed).
pub(crate) fn bucket(n: usize, slots: usize) -> usize {
    let b = if n <= 16 {
        n.next_power_of_two()
    } else {
        n.next_multiple_of(16)
    };
    b.min(slots).max(n)
}

impl Core {
    /// Slots per replica of the fixed cache (0 when the cache grows per call).
    pub fn slots_per_replica(&self) -> usize {
        match self.kv {
            KvMode::Fixed { slots } => slots,
            KvMode::Grow => 0,
        }
    }

    /// Slots of the fixed cache, all replicas together.
    pub fn slot_count(&self) -> usize {
        self.slots_per_replica() * self.topology.replicas()
    }

    /// Maps each `(slot, pages)` of `tables` (the scheduler's [`lifecycle_decoder::KvPages`]):
    /// the slot's positions lie in those pages of its replica's cache from its next prefill on.
    pub fn map_pages(&mut self, tables: &[(usize, &[u32])]) -> Result<(), GpuDecodeError> {
        let spr = self.slots_per_replica();
        if spr == 0 {
            return Err(DecodeError::Usage(
                "paged continuous batching needs the engine's fixed KV cache (allocated at wake)"
                    .into(),
            )
            .into());
        }
        for &(slot, pages) in tables {
            self.pages
                .set_row(slot / spr, slot % spr, pages)
                .map_err(|e| DecodeError::Usage(format!("slot {slot}: {e}")))?;
        }
        Ok(())
    }

    /// Positions slot `slot` holds: its mapped pages'.
    fn room(&self, slot: usize) -> usize {
        let spr = self.slots_per_replica().max(1);
        self.pages.room(slot / spr, slot % spr)
    }

    /// Checks a call of `rows` rows with `picks` picks and sizes the slot table; the slots per
    /// replica.
    fn slot_table(&mut self, picks: usize, rows: usize) -> Result<usize, GpuDecodeError> {
        if picks != rows {
            return Err(DecodeError::Usage(format!("{picks} picks for {rows} rows")).into());
        }
        self.slot_lens()?;
        Ok(self.slots_per_replica())
    }

    /// The slot table is sized for the cache (a cache made since the last slot call, or a
    /// static call in between, left it for another batch).
    fn slot_lens(&mut self) -> Result<(), GpuDecodeError> {
        let total = self.slot_count();
        if total == 0 {
            return Err(DecodeError::Usage(
                "continuous batching needs the engine's fixed KV cache (allocated at wake)".into(),
            )
            .into());
        }
        if self.lens.len() != total {
            self.lens = vec![0; total];
        }
        Ok(())
    }

    /// [`SlotDecoder::prefill_slots`](lifecycle_decoder::SlotDecoder::prefill_slots) on the
    /// device; `fork`: prompts admitted together that are equal are prefilled once per replica
    /// and copied (a group's samples).
    pub fn prefill_slots(
        &mut self,
        pool: &ThreadRankPool,
        admitted: &[(usize, &[u32])],
        picks: &[RowPick],
        fork: bool,
    ) -> Result<Vec<Picked>, GpuDecodeError> {
        let spr = self.slot_table(picks.len(), admitted.len())?;
        self.check_admitted(admitted)?;
        // replica order is the order rows come back in
        let mut order: Vec<usize> = (0..admitted.len()).collect();
        order.sort_by_key(|&i| admitted[i].0);
        let sorted_picks: Vec<RowPick> = order.iter().map(|&i| picks[i]).collect();
        let mut steps = Vec::new();
        let mut at = 0;
        for r in 0..self.topology.replicas() {
            let mine: Vec<(u32, &[u32])> = order
                .iter()
                .map(|&i| admitted[i])
                .filter(|&(s, _)| s / spr == r)
                .map(|(s, p)| ((s % spr) as u32, p))
                .collect();
            let rows = PrefillRows::into_slots(&mine, fork);
            let want = at..at + mine.len();
            at = want.end;
            steps.push(Step::new(
                (rows.tokens, rows.seqs, rows.poss),
                rows.logit_rows,
                rows.forks,
                Pick::Rows(&sorted_picks).rows(want),
                false,
            ));
        }
        let picked = Self::picked(self.forward(pool, steps)?)?;
        for &(slot, prompt) in admitted {
            self.lens[slot] = prompt.len();
        }
        Ok(unsort(&order, picked))
    }

    /// The prompts of a prefill fit their slots and hold tokens of the vocabulary.
    fn check_admitted(&self, admitted: &[(usize, &[u32])]) -> Result<(), GpuDecodeError> {
        for &(slot, prompt) in admitted {
            if slot >= self.lens.len() || prompt.is_empty() || prompt.len() > self.room(slot) {
                return Err(DecodeError::Usage(format!(
                    "a prompt of {} tokens into slot {slot}; the cache holds {} slots, this one \
                     with pages for {} positions (map its pages first)",
                    prompt.len(),
                    self.lens.len(),
                    if slot < self.lens.len() {
                        self.room(slot)
                    } else {
                        0
                    }
                ))
                .into());
            }
            for &t in prompt {
                lifecycle_decoder::check_token(&self.config, slot, t)?;
            }
        }
        Ok(())
    }

    /// The rows of a decode step feed prefilled slots with room for one more position, with
    /// tokens of the vocabulary.
    fn check_fed(&self, rows: &[(usize, u32)]) -> Result<(), GpuDecodeError> {
        for &(slot, t) in rows {
            let len = self.lens.get(slot).copied().unwrap_or(0);
            let room = if slot < self.lens.len() {
                self.room(slot)
            } else {
                0
            };
            if len == 0 || len >= room {
                return Err(DecodeError::Usage(format!(
                    "a decode step for slot {slot} holding {len} positions; the cache holds {} \
                     slots, this one with pages for {room} positions (prefill a slot first)",
                    self.lens.len(),
                ))
                .into());
            }
            lifecycle_decoder::check_token(&self.config, slot, t)?;
        }
        Ok(())
    }

    /// [`SlotDecoder::mixed_slots`](lifecycle_decoder::SlotDecoder::mixed_slots) on the
    /// device: one pass per replica over its admitted prompts' rows (prefix sharing as
    /// [`Core::prefill_slots`]) and its fed rows, picking the prompts' first tokens and the fed
    /// rows' next ones. Not replayed from a graph (its rows change every time); attention split
    /// over the cache where its partial sums are small ([`SplitAttention`]).
    ///
    /// [`SplitAttention`]: crate::SplitAttention
    pub fn mixed_slots(
        &mut self,
        pool: &ThreadRankPool,
        (admitted, admitted_picks): (&[(usize, &[u32])], &[RowPick]),
        (rows, row_picks): (&[(usize, u32)], &[RowPick]),
        fork: bool,
    ) -> Result<(Vec<Picked>, Vec<Picked>), GpuDecodeError> {
        if admitted.is_empty() || rows.is_empty() {
            let first = if admitted.is_empty() {
                Vec::new()
            } else {
                self.prefill_slots(pool, admitted, admitted_picks, fork)?
            };
            let fed = if rows.is_empty() {
                Vec::new()
            } else {
                self.decode_slots(pool, rows, row_picks)?
            };
            return Ok((first, fed));
        }
        let spr = self.slot_table(admitted_picks.len(), admitted.len())?;
        self.slot_table(row_picks.len(), rows.len())?;
        self.check_admitted(admitted)?;
        self.check_fed(rows)?;
        if let Some(&(slot, _)) = admitted
            .iter()
            .find(|(s, _)| rows.iter().any(|(f, _)| f == s))
        {
            return Err(DecodeError::Usage(format!(
                "slot {slot} both admitted and fed in one step"
            ))
            .into());
        }
        let mut a_order: Vec<usize> = (0..admitted.len()).collect();
        a_order.sort_by_key(|&i| admitted[i].0);
        let mut f_order: Vec<usize> = (0..rows.len()).collect();
        f_order.sort_by_key(|&i| rows[i].0);
        // per replica: its prompts' picks, then its fed rows'
        let mut table = Vec::new();
        let mut parts = Vec::new();
        for r in 0..self.topology.replicas() {
            let mine_a: Vec<usize> = a_order
                .iter()
                .copied()
                .filter(|&i| admitted[i].0 / spr == r)
                .collect();
            let mine_f: Vec<usize> = f_order
                .iter()
                .copied()
                .filter(|&i| rows[i].0 / spr == r)
                .collect();
            let prompts: Vec<(u32, &[u32])> = mine_a
                .iter()
                .map(|&i| ((admitted[i].0 % spr) as u32, admitted[i].1))
                .collect();
            let mut step = PrefillRows::into_slots(&prompts, fork);
            let start = table.len();
            table.extend(mine_a.iter().map(|&i| admitted_picks[i]));
            for &i in &mine_f {
                let (slot, t) = rows[i];
                step.logit_rows.push(step.tokens.len() as u32);
                step.tokens.push(t);
                step.seqs.push((slot % spr) as u32);
                step.poss.push(self.lens[slot] as u32);
                table.push(row_picks[i]);
            }
            parts.push((step, start..table.len(), mine_a.len()));
        }
        let counts: Vec<(usize, usize)> = parts.iter().map(|(_, w, a)| (w.len(), *a)).collect();
        let steps: Vec<Step<'_>> = parts
            .into_iter()
            .map(|(rows, want, _)| {
                Step::new(
                    (rows.tokens, rows.seqs, rows.poss),
                    rows.logit_rows,
                    rows.forks,
                    Pick::Rows(&table).rows(want),
                    false,
                )
            })
            .collect();
        let picked = Self::picked(self.forward(pool, steps)?)?;
        let (mut first, mut fed) = (Vec::new(), Vec::new());
        let mut it = picked.into_iter();
        for &(wanted, n_admitted) in &counts {
            let mine: Vec<Picked> = it.by_ref().take(wanted).collect();
            let (a, f) = mine.split_at(n_admitted.min(mine.len()));
            first.extend_from_slice(a);
            fed.extend_from_slice(f);
        }
        for &(slot, prompt) in admitted {
            self.lens[slot] = prompt.len();
        }
        for &(slot, _) in rows {
            self.lens[slot] += 1;
        }
        Ok((unsort(&a_order, first), unsort(&f_order, fed)))
    }

    /// [`SlotDecoder::decode_slots`](lifecycle_decoder::SlotDecoder::decode_slots) on the
    /// device: `rows` must name every slot holding a running request (the others are free and
    /// may be padded into).
    pub fn decode_slots(
        &mut self,
        pool: &ThreadRankPool,
        rows: &[(usize, u32)],
        picks: &[RowPick],
    ) -> Result<Vec<Picked>, GpuDecodeError> {
        let spr = self.slot_table(picks.len(), rows.len())?;
        self.check_fed(rows)?;
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.sort_by_key(|&i| rows[i].0);
        let mut table: Vec<RowPick> = Vec::new();
        let mut steps = Vec::new();
        let mut real = Vec::new();
        for r in 0..self.topology.replicas() {
            let mine: Vec<usize> = order
                .iter()
                .copied()
                .filter(|&i| rows[i].0 / spr == r)
                .collect();
            let n = if mine.is_empty() {
                0
            } else {
                bucket(mine.len(), spr)
            };
            let padding = self.pages.padding_row();
            let (mut tokens, mut seqs, mut poss) = (Vec::new(), Vec::new(), Vec::new());
            let start = table.len();
            for &i in &mine {
                let (slot, t) = rows[i];
                tokens.push(t);
                seqs.push((slot % spr) as u32);
                poss.push(self.lens[slot] as u32);
                table.push(picks[i]);
            }
            for _ in mine.len()..n {
                tokens.push(0);
                seqs.push(padding as u32);
                poss.push(0);
                table.push(RowPick::GREEDY);
            }
            real.push((mine.len(), n));
            steps.push((tokens, seqs, poss, start..table.len()));
        }
        let steps: Vec<Step<'_>> = steps
            .into_iter()
            .map(|(tokens, seqs, poss, want)| {
                let logit_rows = (0..tokens.len() as u32).collect();
                Step::new(
                    (tokens, seqs, poss),
                    logit_rows,
                    Vec::new(),
                    Pick::Rows(&table).rows(want),
                    true,
                )
            })
            .collect();
        let picked = Self::picked(self.forward(pool, steps)?)?;
        // drop each replica's padding rows
        let mut kept = Vec::with_capacity(rows.len());
        let mut it = picked.into_iter();
        for (n_real, n) in real {
            kept.extend(it.by_ref().take(n).take(n_real));
        }
        for &(slot, _) in rows {
            self.lens[slot] += 1;
        }
        Ok(unsort(&order, kept))
    }

    fn picked(out: StepOut) -> Result<Vec<Picked>, GpuDecodeError> {
        match out {
            StepOut::Picked(p) => Ok(p),
            _ => Err(
                lifecycle_cuda::CudaError::Invalid("no rank returned picked tokens".into()).into(),
            ),
        }
    }
}

/// `picked[k]` is the pick of input `order[k]`: the picks back in input order.
fn unsort(order: &[usize], picked: Vec<Picked>) -> Vec<Picked> {
    let mut out = vec![None; order.len()];
    for (&i, p) in order.iter().zip(picked) {
        if let Some(o) = out.get_mut(i) {
            *o = Some(p);
        }
    }
    out.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::bucket;

    #[test]
    fn buckets_are_few_and_never_past_the_slots() {
        let sizes: Vec<usize> = (1..=64).map(|n| bucket(n, 64)).collect();
        let mut distinct = sizes.clone();
        distinct.dedup();
        assert_eq!(distinct, vec![1, 2, 4, 8, 16, 32, 48, 64]);
        assert!(sizes.iter().enumerate().all(|(i, &b)| b > i));
        assert_eq!(bucket(5, 6), 6);
        assert_eq!(bucket(17, 20), 20);
        assert_eq!(bucket(3, 3), 3);
    }
}
