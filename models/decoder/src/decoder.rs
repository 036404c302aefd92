//! The interface every decoder implements (the CPU reference now, a GPU one later).

use crate::sampling::{sample_token, Sampling, SplitMix64};

/// Which logits [`Decoder::prefill`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillLogits {
    /// The last position of each prompt (what generation needs).
    Last,
    /// Every position of each prompt, row-major `[len × vocab]`.
    All,
}

/// A batched autoregressive decoder with a KV cache.
///
/// `prefill` starts a new batch (dropping any previous cache); `decode_step` feeds one token per
/// sequence of that batch. `generate` drives both with [`Sampling`]. [`CpuDecoder`](crate::CpuDecoder)
/// is the reference implementation; code written against the trait runs on any of them:
///
/// ```
/// use lifecycle_decoder::{argmax, Decoder, PrefillLogits};
///
/// /// Greedy continuation by hand: prefill, then feed back the argmax.
/// fn greedy<D: Decoder>(d: &mut D, prompt: Vec<u32>, n: usize) -> Result<Vec<u32>, D::Error> {
///     let mut logits = d.prefill(&[prompt], PrefillLogits::Last)?.remove(0);
///     let mut out = Vec::new();
///     for _ in 0..n {
///         let next = argmax(&logits) as u32;
///         out.push(next);
///         logits = d.decode_step(&[next])?.remove(0);
///     }
///     Ok(out)
/// }
/// # let _ = greedy::<lifecycle_decoder::CpuDecoder<'static>>;
/// ```
pub trait Decoder {
    /// Why a call failed.
    type Error: std::error::Error;

    /// Vocabulary size (length of one logits row).
    fn vocab_size(&self) -> usize;

    /// Runs the prompts through the model, filling the KV cache; one logits vector per prompt.
    fn prefill(
        &mut self,
        prompts: &[Vec<u32>],
        logits: PrefillLogits,
    ) -> Result<Vec<Vec<f32>>, Self::Error>;

    /// Appends one token to every sequence of the batch; the next-token logits of each.
    fn decode_step(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, Self::Error>;

    /// Generates up to `sampling.max_new_tokens` tokens after each prompt. Sequence `i` samples
    /// with `SplitMix64::from_keys(&[sampling.seed, i])`, so its tokens do not depend on the rest
    /// of the batch.
    fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        sampling: &Sampling,
    ) -> Result<Vec<Vec<u32>>, Self::Error> {
        let mut rngs: Vec<SplitMix64> = (0..prompts.len())
            .map(|i| SplitMix64::from_keys(&[sampling.seed, i as u64]))
            .collect();
        let mut out: Vec<Vec<u32>> =
            vec![Vec::with_capacity(sampling.max_new_tokens); prompts.len()];
        let mut done = vec![false; prompts.len()];
        if sampling.max_new_tokens == 0 || prompts.is_empty() {
            return Ok(out);
        }
        let mut logits = self.prefill(prompts, PrefillLogits::Last)?;
        for step in 0..sampling.max_new_tokens {
            let next: Vec<u32> = logits
                .iter()
                .zip(rngs.iter_mut())
                .map(|(l, rng)| sample_token(l, sampling.temperature, rng) as u32)
                .collect();
            for ((o, d), &t) in out.iter_mut().zip(done.iter_mut()).zip(&next) {
                if !*d {
                    o.push(t);
                    *d = sampling.stop_token == Some(t);
                }
            }
            if step + 1 == sampling.max_new_tokens || done.iter().all(|&d| d) {
                break;
            }
            logits = self.decode_step(&next)?;
        }
        Ok(out)
    }
}
