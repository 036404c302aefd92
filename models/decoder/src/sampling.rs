//! Sampling settings, a seeded generator and the token sampler.

/// How [`Decoder::generate`](crate::Decoder::generate) picks tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Softmax temperature; 0 is greedy (argmax, lowest index on ties).
    pub temperature: f32,
    /// Tokens to generate per sequence.
    pub max_new_tokens: usize,
    /// Seed; sequence `i` samples from `SplitMix64::from_keys(&[seed, i])`.
    pub seed: u64,
    /// A token that ends a sequence (kept in its output), if any.
    pub stop_token: Option<u32>,
}

impl Sampling {
    /// Greedy decoding of `max_new_tokens` tokens.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Sampling {
            temperature: 0.0,
            max_new_tokens,
            seed: 0,
            stop_token: None,
        }
    }
}

/// SplitMix64: a small deterministic generator, so samples are reproducible from a seed.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// A generator derived from several keys.
    pub fn from_keys(keys: &[u64]) -> Self {
        let mut g = SplitMix64(0x5EED);
        for &k in keys {
            g.0 ^= k;
            g.next_u64();
        }
        g
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [-scale, scale).
    pub fn symmetric(&mut self, scale: f32) -> f32 {
        (self.next_f32() * 2.0 - 1.0) * scale
    }
}

/// Index of the largest logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> usize {
    logits
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 {
                (i, v)
            } else {
                best
            }
        })
        .0
}

/// Samples an index from `softmax(logits / temperature)`; greedy when `temperature` ≤ 0.
///
/// ```
/// use lifecycle_decoder::{sample_token, SplitMix64};
/// let mut rng = SplitMix64::new(1);
/// assert_eq!(sample_token(&[0.0, 3.0, 1.0], 0.0, &mut rng), 1);
/// assert!(sample_token(&[0.0, 3.0, 1.0], 1.0, &mut rng) < 3);
/// ```
pub fn sample_token(logits: &[f32], temperature: f32, rng: &mut SplitMix64) -> usize {
    if temperature <= 0.0 {
        return argmax(logits);
    }
    let params = crate::SamplingParams::new(1).with_temperature(temperature);
    crate::pick(logits, &params, rng.next_f32()).token as usize
}
