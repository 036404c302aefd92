//! The rows of one replica's prefill pass, with or without forking: when several sequences of a
//! call share a prompt, only the first of them (its leader) runs through the model; the others
//! get a copy of the leader's KV rows and read the leader's last hidden row for their first
//! token. Pure host logic, so it is tested without a GPU.

use std::collections::HashMap;

/// One replica's prefill pass: what goes to the device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PrefillRows {
    /// Tokens of the rows run through the model.
    pub tokens: Vec<u32>,
    /// The cache slot (sequence index within the replica) of each row.
    pub seqs: Vec<u32>,
    /// The position of each row.
    pub poss: Vec<u32>,
    /// The rows whose logits are wanted, in sequence order (a forked sequence names its leader's
    /// last row).
    pub logit_rows: Vec<u32>,
    /// `[leader slot, sequence slot, prompt length]` per forked sequence, flattened.
    pub forks: Vec<u32>,
}

impl PrefillRows {
    /// The rows of `prompts` (one replica's share, sequence `i` in cache slot `i`). `all`:
    /// logits of every row (no forking then); otherwise of each sequence's last token. `fork`:
    /// sequences whose prompt equals an earlier one's are forked from it.
    pub(crate) fn new(prompts: &[Vec<u32>], all: bool, fork: bool) -> Self {
        let slots = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| (i as u32, p.as_slice()));
        Self::build(slots, all, fork)
    }

    /// The rows of prompts admitted into the given cache slots of one replica (each slot's
    /// earlier contents overwritten), logits of each one's last token; `fork` as in
    /// [`PrefillRows::new`].
    pub(crate) fn into_slots(admitted: &[(u32, &[u32])], fork: bool) -> Self {
        Self::build(admitted.iter().copied(), false, fork)
    }

    fn build<'p>(slots: impl Iterator<Item = (u32, &'p [u32])>, all: bool, fork: bool) -> Self {
        let fork = fork && !all;
        let mut out = PrefillRows::default();
        let mut leaders: HashMap<&[u32], (u32, u32)> = HashMap::new();
        for (slot, p) in slots {
            if fork && let Some(&(leader, last)) = leaders.get(p) {
                out.logit_rows.push(last);
                out.forks.extend([leader, slot, p.len() as u32]);
                continue;
            }
            for (pos, &t) in p.iter().enumerate() {
                if all || pos + 1 == p.len() {
                    out.logit_rows.push(out.tokens.len() as u32);
                }
                out.seqs.push(slot);
                out.poss.push(pos as u32);
                out.tokens.push(t);
            }
            if fork && !p.is_empty() {
                leaders.insert(p, (slot, out.tokens.len() as u32 - 1));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_forking_every_sequence_is_prefilled() {
        let prompts = vec![vec![1, 2, 3], vec![1, 2, 3], vec![4, 5]];
        let r = PrefillRows::new(&prompts, false, false);
        assert_eq!(r.tokens, vec![1, 2, 3, 1, 2, 3, 4, 5]);
        assert_eq!(r.seqs, vec![0, 0, 0, 1, 1, 1, 2, 2]);
        assert_eq!(r.poss, vec![0, 1, 2, 0, 1, 2, 0, 1]);
        assert_eq!(r.logit_rows, vec![2, 5, 7]);
        assert!(r.forks.is_empty());
    }

    #[test]
    fn a_group_of_one_prompt_is_prefilled_once_and_forked() {
        // DAPO order: G = 3 samples of prompt a, then 3 of prompt b
        let (a, b) = (vec![7, 8, 9], vec![3, 4]);
        let prompts = vec![a.clone(), a.clone(), a, b.clone(), b.clone(), b];
        let r = PrefillRows::new(&prompts, false, true);
        assert_eq!(r.tokens, vec![7, 8, 9, 3, 4]);
        assert_eq!(r.seqs, vec![0, 0, 0, 3, 3]);
        assert_eq!(r.poss, vec![0, 1, 2, 0, 1]);
        // one logit row per sequence, in sequence order: the leaders' last rows
        assert_eq!(r.logit_rows, vec![2, 2, 2, 4, 4, 4]);
        assert_eq!(r.forks, vec![0, 1, 3, 0, 2, 3, 3, 4, 2, 3, 5, 2]);
    }

    #[test]
    fn interleaved_duplicates_fork_from_their_first_occurrence() {
        let prompts = vec![vec![1], vec![2, 2], vec![1], vec![2, 2]];
        let r = PrefillRows::new(&prompts, false, true);
        assert_eq!(r.tokens, vec![1, 2, 2]);
        assert_eq!(r.seqs, vec![0, 1, 1]);
        assert_eq!(r.logit_rows, vec![0, 2, 0, 2]);
        assert_eq!(r.forks, vec![0, 2, 1, 1, 3, 2]);
    }

    #[test]
    fn prompts_admitted_into_free_slots_fork_within_the_admission() {
        let (a, b) = (vec![7u32, 8], vec![5u32]);
        let admitted = [(4, a.as_slice()), (1, b.as_slice()), (6, a.as_slice())];
        let r = PrefillRows::into_slots(&admitted, true);
        assert_eq!(r.tokens, vec![7, 8, 5]);
        assert_eq!(r.seqs, vec![4, 4, 1]);
        assert_eq!(r.poss, vec![0, 1, 0]);
        assert_eq!(r.logit_rows, vec![1, 2, 1]);
        assert_eq!(r.forks, vec![4, 6, 2]);
    }

    #[test]
    fn all_logits_never_fork() {
        let prompts = vec![vec![1, 2], vec![1, 2]];
        let r = PrefillRows::new(&prompts, true, true);
        assert_eq!(r.tokens.len(), 4);
        assert_eq!(r.logit_rows, vec![0, 1, 2, 3]);
        assert!(r.forks.is_empty());
    }
}
