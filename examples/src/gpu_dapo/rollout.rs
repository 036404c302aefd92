//! The GPU runs' prompts and verifiable reward, what a run shares, and the FSDP update between
//! training steps.

use lifecycle_decoder::ModelConfig;
use lifecycle_fsdp::{FsdpBackend, FsdpTrainState};
use lifecycle_layout::AdamParams;

use super::{DapoGpuError, Options};

/// Prompt `id`'s tokens and its reward target.
pub(crate) fn prompt(id: u64, len: usize, vocab: usize, modulus: u32) -> (Vec<u32>, u32) {
    let v = vocab as u64;
    let tokens = (0..len as u64)
        .map(|k| ((id * 31 + k * 7 + 3) % v) as u32)
        .collect();
    (tokens, ((id * 13 + 5) % u64::from(modulus)) as u32)
}

/// The verifiable reward: 1 if a generated token `t` has `t mod modulus == target`.
pub(crate) fn reward(sample: &[u32], target: u32, modulus: u32) -> f32 {
    if sample.iter().any(|&t| t % modulus == target) {
        1.0
    } else {
        0.0
    }
}

/// What every gen batch and step of a run shares.
pub(crate) struct Ctx<'a> {
    pub(crate) options: &'a Options,
    pub(crate) config: &'a ModelConfig,
    /// M of the reward rule (`--reward-modulus` capped at the vocabulary size).
    pub(crate) modulus: u32,
    /// Whether this process prints the report (rank 0, or the only process).
    pub(crate) root: bool,
}

/// The update between training steps: synthetic gradients and one Adam step, in place.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Update {
    pub(crate) params: AdamParams,
    pub(crate) grad_scale: f32,
    pub(crate) seed: u64,
}

impl Update {
    /// Fills the gradients of `step` (1-based) and applies the Adam step, on the GPUs.
    pub(crate) fn apply(
        &self,
        backend: &FsdpBackend,
        state: &mut FsdpTrainState,
        step: usize,
    ) -> Result<(), DapoGpuError> {
        let seed = self
            .seed
            .wrapping_add(0x9E37_79B9_7F4A_7C15u64.wrapping_mul(step as u64));
        backend.fill_synthetic_grads(state, seed, self.grad_scale)?;
        backend.adam_step(state, self.params)?;
        Ok(())
    }

    /// What the update is, for the output.
    pub(crate) fn describe(&self) -> String {
        let p = self.params;
        format!(
            "update: Adam step on synthetic gradients, not a learned update: seeded uniform noise \
             in [-{}, {}) written into the gradient shards on the GPUs, then one Adam step (lr {}, \
             betas {} / {}, eps {}) in place on the fp32 master, m, v shards \
             (FsdpBackend::fill_synthetic_grads + adam_step); nothing reallocated, the pinned host \
             offload buffers reused",
            self.grad_scale, self.grad_scale, p.lr, p.beta1, p.beta2, p.eps
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dapo::Group;

    #[test]
    fn reward_rule_and_groups() {
        let (tokens, target) = prompt(3, 8, 4096, 150);
        assert_eq!(tokens.len(), 8);
        assert!(target < 150);
        assert_eq!(reward(&[target + 150, 7], target, 150), 1.0);
        assert_eq!(reward(&[(target + 1) % 150], target, 150), 0.0);
        let g = Group {
            prompt: 0,
            samples: vec![vec![], vec![]],
            rewards: vec![1.0, 0.0],
            logprobs: Vec::new(),
        };
        assert!(!g.uniform());
    }
}
