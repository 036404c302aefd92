//! The CPU decoder as a [`SlotDecoder`]: the reference of continuous batching. Every row is
//! computed alone, so a request's logits, and so its tokens, are bitwise the same whatever
//! shares its steps.

use crate::cpu::CpuDecoder;
use crate::error::DecodeError;
use crate::rollout::pages::KvPaging;
use crate::rollout::pick::{pick, Picked};
use crate::rollout::scheduler::{PickArgs, SlotDecoder};

impl CpuDecoder<'_> {
    /// Runs `rows` (slot, position) with `tokens` and picks a token from the logits of the
    /// rows `last` names, with `picks[i]` for `last[i]`.
    fn run_and_pick(
        &mut self,
        rows: &[(usize, usize)],
        tokens: &[u32],
        last: &[usize],
        picks: &[PickArgs<'_>],
    ) -> Result<Vec<Picked>, DecodeError> {
        if picks.len() != last.len() {
            return Err(DecodeError::Usage(format!(
                "{} picks for {} rows",
                picks.len(),
                last.len()
            )));
        }
        for (&(slot, _), &t) in rows.iter().zip(tokens) {
            crate::check_token(self.model_config(), slot, t)?;
        }
        let x = self.forward(rows, tokens);
        let h = x.len() / rows.len().max(1);
        Ok(last
            .iter()
            .zip(picks)
            .map(|(&r, a)| pick(&self.logits(&x[r * h..(r + 1) * h]), a.params, a.uniform))
            .collect())
    }
}

impl SlotDecoder for CpuDecoder<'_> {
    type Error = DecodeError;

    fn vocab_size(&self) -> usize {
        self.model_config().model.vocab
    }

    fn slots(&self) -> usize {
        self.slot_room.0
    }

    fn slot_positions(&self) -> usize {
        self.slot_room.1
    }

    fn paging(&self) -> Option<KvPaging> {
        self.paged.as_ref().map(|(p, _)| *p)
    }

    /// Checks that each table's pages lie in the cache and records the positions they hold.
    fn map_pages(&mut self, tables: &[(usize, &[u32])]) -> Result<(), DecodeError> {
        let slots = self.slots();
        let Some((paging, room)) = self.paged.as_mut() else {
            return Err(DecodeError::Usage(
                "pages mapped on a CPU decoder that is not paged (with_kv_pages)".into(),
            ));
        };
        for &(slot, pages) in tables {
            if slot >= slots {
                return Err(DecodeError::Usage(format!(
                    "pages mapped to slot {slot}; the decoder holds {slots} slots"
                )));
            }
            if let Some(&p) = pages
                .iter()
                .find(|&&p| p as usize >= paging.pages_per_group)
            {
                return Err(DecodeError::Usage(format!(
                    "page {p} mapped to slot {slot}; the cache holds {} pages",
                    paging.pages_per_group
                )));
            }
            room[slot] = pages.len() * paging.page_positions;
        }
        Ok(())
    }

    /// A paged CPU decoder counts pages as an engine that shares prefixes does (its own KV is
    /// per slot, so sharing changes no value).
    fn shares_prefixes(&self) -> bool {
        self.paged.is_some()
    }

    fn prefill_slots(
        &mut self,
        admitted: &[(usize, &[u32])],
        picks: &[PickArgs<'_>],
    ) -> Result<Vec<Picked>, DecodeError> {
        let (mut rows, mut tokens, mut last) = (Vec::new(), Vec::new(), Vec::new());
        for &(slot, prompt) in admitted {
            if slot >= self.slots() || prompt.is_empty() || prompt.len() > self.room_of(slot) {
                return Err(DecodeError::Usage(format!(
                    "prefill of {} tokens into slot {slot}; the decoder holds {} slots, this one \
                     of {} positions (prompts are not empty)",
                    prompt.len(),
                    self.slots(),
                    self.room_of(slot)
                )));
            }
            self.reset_slot(slot);
            rows.extend((0..prompt.len()).map(|p| (slot, p)));
            tokens.extend_from_slice(prompt);
            last.push(rows.len() - 1);
        }
        self.run_and_pick(&rows, &tokens, &last, picks)
    }

    fn decode_slots(
        &mut self,
        rows: &[(usize, u32)],
        picks: &[PickArgs<'_>],
    ) -> Result<Vec<Picked>, DecodeError> {
        let mut at = Vec::with_capacity(rows.len());
        for &(slot, _) in rows {
            let len = self.slot_len(slot);
            if slot >= self.slots() || len == 0 || len >= self.room_of(slot) {
                return Err(DecodeError::Usage(format!(
                    "a decode step for slot {slot} holding {len} positions; the decoder holds {} \
                     slots, this one of {} positions (prefill a slot first)",
                    self.slots(),
                    self.room_of(slot)
                )));
            }
            at.push((slot, len));
        }
        let tokens: Vec<u32> = rows.iter().map(|r| r.1).collect();
        let last: Vec<usize> = (0..rows.len()).collect();
        self.run_and_pick(&at, &tokens, &last, picks)
    }
}
