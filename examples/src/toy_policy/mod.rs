//! A small policy that runs directly on the rollout tensor-parallel layout of the host backend.
//!
//! Architecture (names follow Hugging Face's Qwen2 / Llama so the default splits apply): a
//! vocabulary-parallel embedding, `layers` residual MLP blocks (RMSNorm, column-parallel
//! `up_proj`, ReLU, row-parallel `down_proj` followed by a sum over the TP group — the all-reduce),
//! a final RMSNorm and a vocabulary-parallel `lm_head`. A recurrent mix of the previous hidden
//! state makes each token depend on the whole history. Every output depends on every weight, so
//! sampling from stale weights changes the samples.
//!
//! The rollout side ([`TpGroup`]) reads the bf16 tensor-parallel slices; the training side
//! ([`train::Params`]) runs the same function on the full fp32 master tensors and backpropagates
//! through it.

use half::bf16;
use lifecycle_host::HostError;
use lifecycle_layout::HostTensor;
use lifecycle_layout::RankRollout;
use lifecycle_layout::{Parallel, RolloutLayout, TensorSpec};

use lifecycle_decoder::{dot, pick, SamplingParams};

use crate::rng::SplitMix64;

pub mod train;

pub use train::{Forward, ForwardError, Params, Sequence};

/// Sizes of the toy policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Hidden size.
    pub hidden: usize,
    /// MLP intermediate size.
    pub ffn: usize,
    /// Number of MLP blocks.
    pub layers: usize,
}

impl PolicyConfig {
    /// Every tensor with its shape and rollout split.
    pub fn specs(&self) -> Vec<TensorSpec> {
        let (v, h, f) = (self.vocab, self.hidden, self.ffn);
        let mut specs = vec![TensorSpec::new(
            "model.embed_tokens.weight",
            [v, h],
            Parallel::Column,
        )];
        for l in 0..self.layers {
            specs.push(TensorSpec::new(
                format!("model.layers.{l}.post_attention_layernorm.weight"),
                [h],
                Parallel::Replicated,
            ));
            specs.push(TensorSpec::new(
                format!("model.layers.{l}.mlp.up_proj.weight"),
                [f, h],
                Parallel::Column,
            ));
            specs.push(TensorSpec::new(
                format!("model.layers.{l}.mlp.down_proj.weight"),
                [h, f],
                Parallel::Row,
            ));
        }
        specs.push(TensorSpec::new(
            "model.norm.weight",
            [h],
            Parallel::Replicated,
        ));
        specs.push(TensorSpec::new("lm_head.weight", [v, h], Parallel::Column));
        specs
    }

    /// Parameter count.
    pub fn params(&self) -> usize {
        self.specs().iter().map(TensorSpec::numel).sum()
    }

    /// The rollout layout at tensor-parallel degree `tp`.
    pub fn rollout_layout(&self, tp: usize) -> Result<RolloutLayout, HostError> {
        Ok(RolloutLayout::new(tp, self.specs())?)
    }

    /// Randomly initialised full tensors (norm weights start at one).
    pub fn init(&self, seed: u64) -> Vec<HostTensor> {
        let mut rng = SplitMix64::new(seed);
        self.specs()
            .into_iter()
            .map(|s| {
                let fan_in = *s.shape.last().unwrap_or(&1) as f32;
                let scale = if s.name.contains("embed") {
                    1.0
                } else {
                    1.7 / fan_in.sqrt()
                };
                let data = if s.shape.len() == 1 {
                    vec![1.0; s.numel()]
                } else {
                    (0..s.numel()).map(|_| rng.symmetric(scale)).collect()
                };
                HostTensor::f32(s.name, s.shape, data)
            })
            .collect()
    }
}

/// One tensor-parallel group's view of the rollout weights: slice `r` of every tensor comes from
/// TP rank `r`.
pub struct TpGroup<'w> {
    ranks: Vec<&'w RankRollout>,
    config: PolicyConfig,
}

fn tensor<'w>(rank: &'w RankRollout, name: &str) -> &'w [bf16] {
    match rank.tensor(name) {
        Some(t) => &t.data,
        None => &[],
    }
}

fn rms_norm(x: &[f32], w: &[bf16]) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + 1e-6).sqrt();
    x.iter().zip(w).map(|(v, g)| v * inv * g.to_f32()).collect()
}

fn matvec_into(w: &[bf16], x: &[f32], out: &mut [f32]) {
    let cols = x.len();
    for (o, row) in out.iter_mut().zip(w.chunks_exact(cols)) {
        *o = dot(row, x);
    }
}

impl<'w> TpGroup<'w> {
    /// The group made of `ranks` (TP ranks 0..T in order) for a policy of `config`.
    pub fn new(ranks: Vec<&'w RankRollout>, config: PolicyConfig) -> Self {
        TpGroup { ranks, config }
    }

    /// Logits of the next token given the current token and the recurrent state.
    fn step(&self, token: usize, state: &mut [f32]) -> Vec<f32> {
        let c = self.config;
        let t = self.ranks.len();
        let (v_part, f_part) = (c.vocab / t, c.ffn / t);
        // vocabulary-parallel embedding: the rank owning the row provides it
        let owner = self.ranks[token / v_part];
        let row = token % v_part;
        let emb = &tensor(owner, "model.embed_tokens.weight")[row * c.hidden..(row + 1) * c.hidden];
        let mut x: Vec<f32> = emb
            .iter()
            .zip(state.iter())
            .map(|(e, s)| e.to_f32() + 0.5 * s)
            .collect();
        let mut u = vec![0.0f32; f_part];
        let mut y = vec![0.0f32; c.hidden];
        for l in 0..c.layers {
            let norm = rms_norm(
                &x,
                tensor(
                    self.ranks[0],
                    &format!("model.layers.{l}.post_attention_layernorm.weight"),
                ),
            );
            let mut sum = vec![0.0f32; c.hidden];
            for rank in &self.ranks {
                matvec_into(
                    tensor(rank, &format!("model.layers.{l}.mlp.up_proj.weight")),
                    &norm,
                    &mut u,
                );
                u.iter_mut().for_each(|v| *v = v.max(0.0));
                matvec_into(
                    tensor(rank, &format!("model.layers.{l}.mlp.down_proj.weight")),
                    &u,
                    &mut y,
                );
                // all-reduce (sum) of the row-parallel partial outputs
                sum.iter_mut().zip(&y).for_each(|(s, v)| *s += v);
            }
            x.iter_mut().zip(&sum).for_each(|(a, b)| *a += b);
        }
        state.copy_from_slice(&x);
        let h = rms_norm(&x, tensor(self.ranks[0], "model.norm.weight"));
        let mut logits = vec![0.0f32; c.vocab];
        for (rank, out) in self.ranks.iter().zip(logits.chunks_mut(v_part)) {
            matvec_into(tensor(rank, "lm_head.weight"), &h, out);
        }
        logits
    }

    /// The log-probability of each token of `completion` after `prompt` under
    /// `softmax(logits / temperature)` on these rollout weights (temperature 0 scores at 1, as
    /// [`train::Params::forward`] does); tokens outside the vocabulary score `-inf`.
    pub fn score(&self, prompt: &[usize], completion: &[usize], temperature: f32) -> Vec<f32> {
        let t = if temperature > 0.0 { temperature } else { 1.0 };
        let mut state = vec![0.0f32; self.config.hidden];
        let mut logits = Vec::new();
        for &tok in prompt {
            logits = self.step(tok % self.config.vocab, &mut state);
        }
        let mut out = Vec::with_capacity(completion.len());
        for &tok in completion {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) / t;
            let total: f32 = logits.iter().map(|l| (l / t - max).exp()).sum();
            out.push(match logits.get(tok) {
                Some(l) => l / t - max - total.ln(),
                None => f32::NEG_INFINITY,
            });
            if tok >= self.config.vocab {
                break;
            }
            logits = self.step(tok, &mut state);
        }
        out
    }

    /// Samples `len` tokens after `prompt` at `temperature` with `rng`.
    pub fn sample(
        &self,
        prompt: &[usize],
        len: usize,
        temperature: f32,
        rng: &mut SplitMix64,
    ) -> Vec<usize> {
        self.sample_with_logprobs(prompt, len, temperature, rng).0
    }

    /// Samples `len` tokens after `prompt` at `temperature` with `rng` (the same tokens as
    /// [`TpGroup::sample`]), and each token's log-probability on these rollout weights:
    /// `log_softmax(logits / temperature)` of the token drawn, as the decoder's
    /// [`Sample::logprobs`](lifecycle_decoder::Sample) (temperature 0, greedy, scores at 1, as
    /// [`train::Params::forward`] does).
    pub fn sample_with_logprobs(
        &self,
        prompt: &[usize],
        len: usize,
        temperature: f32,
        rng: &mut SplitMix64,
    ) -> (Vec<usize>, Vec<f32>) {
        let mut state = vec![0.0f32; self.config.hidden];
        let mut logits = Vec::new();
        for &tok in prompt {
            logits = self.step(tok % self.config.vocab, &mut state);
        }
        // greedy at temperature ≤ 0, without a draw (as `lifecycle_decoder::sample_token`)
        let params = SamplingParams::new(1).with_temperature(temperature.max(0.0));
        let (mut out, mut logprobs) = (Vec::with_capacity(len), Vec::with_capacity(len));
        for _ in 0..len {
            let uniform = if params.greedy() { 0.0 } else { rng.next_f32() };
            let picked = pick(&logits, &params, uniform);
            let next = picked.token as usize;
            out.push(next);
            logprobs.push(picked.logprob);
            logits = self.step(next, &mut state);
        }
        (out, logprobs)
    }
}
