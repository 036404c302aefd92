//! What one rollout request asks for ([`Request`], [`SamplingParams`]) and what it gives back
//! ([`Sample`], [`FinishReason`]); every field is checked by [`Request::check`] before a request
//! is queued.

use crate::error::DecodeError;

/// How one request picks its tokens (the sampling settings RL stacks pass per request).
///
/// The token at each step is drawn from `softmax(logits / temperature)` restricted to the
/// `top_k` largest logits, then to the smallest set of those whose renormalised probability mass
/// reaches `top_p` (both keep every token tied with the last one kept), renormalised; the draw
/// uses the request's own generator ([`SamplingParams::seed`]), one uniform per token, so a
/// request's tokens depend only on its logits and its seed, never on which other requests share
/// its steps. Temperature 0 is greedy (the argmax, the lowest index on ties).
///
/// ```
/// use lifecycle_decoder::SamplingParams;
/// let p = SamplingParams::new(512).with_temperature(1.0).with_top_p(0.95).with_top_k(50)
///     .with_stop_tokens(vec![151643, 151645]).with_seed(7);
/// assert!(p.check(151_936).is_ok());
/// let e = SamplingParams::new(8).with_top_p(1.5).check(100).unwrap_err();
/// assert!(e.to_string().contains("top_p"), "{e}");
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature, `>= 0` and finite; 0 is greedy.
    pub temperature: f32,
    /// Keep the smallest set of the most likely tokens whose mass reaches `top_p`; in `(0, 1]`,
    /// 1 keeps every token.
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (and any tied with the last); `None` keeps every
    /// token.
    pub top_k: Option<u32>,
    /// Tokens that end the sample (kept in its output as its last token).
    pub stop_tokens: Vec<u32>,
    /// The most tokens the sample may hold (its finish reason is
    /// [`FinishReason::Length`] when it reaches them).
    pub max_new_tokens: usize,
    /// The request's generator is `SplitMix64::from_keys(&[seed])`, one draw per token.
    pub seed: u64,
}

impl SamplingParams {
    /// Greedy decoding of at most `max_new_tokens` tokens, no stop token.
    pub fn new(max_new_tokens: usize) -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: None,
            stop_tokens: Vec::new(),
            max_new_tokens,
            seed: 0,
        }
    }

    /// The same with softmax temperature `t` (0: greedy).
    pub fn with_temperature(mut self, t: f32) -> Self {
        self.temperature = t;
        self
    }

    /// The same with nucleus mass `p`.
    pub fn with_top_p(mut self, p: f32) -> Self {
        self.top_p = p;
        self
    }

    /// The same keeping the `k` most likely tokens.
    pub fn with_top_k(mut self, k: u32) -> Self {
        self.top_k = Some(k);
        self
    }

    /// The same ending at any of `stops`.
    pub fn with_stop_tokens(mut self, stops: Vec<u32>) -> Self {
        self.stop_tokens = stops;
        self
    }

    /// The same with generator seed `seed`.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The seed of request `index` of a call given one `seed` for all:
    /// `SplitMix64::from_keys(&[seed, index])`'s first word, so the requests of a call draw
    /// apart and a request's draws do not depend on the call's other requests.
    ///
    /// ```
    /// use lifecycle_decoder::SamplingParams;
    /// assert_ne!(SamplingParams::seed_of(7, 0), SamplingParams::seed_of(7, 1));
    /// assert_eq!(SamplingParams::seed_of(7, 3), SamplingParams::seed_of(7, 3));
    /// ```
    pub fn seed_of(seed: u64, index: u64) -> u64 {
        crate::sampling::SplitMix64::from_keys(&[seed, index]).next_u64()
    }

    /// Whether the draw is the argmax.
    pub fn greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks every field against a vocabulary of `vocab` tokens; the error names the field,
    /// what it must be and what it is.
    pub fn check(&self, vocab: usize) -> Result<(), DecodeError> {
        let bad = |field: &'static str, problem: String| DecodeError::Request {
            request: None,
            field,
            problem,
        };
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(bad(
                "temperature",
                format!(
                    "must be finite and >= 0 (0 is greedy), got {}",
                    self.temperature
                ),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(bad(
                "top_p",
                format!(
                    "must lie in (0, 1] (1 keeps every token), got {}",
                    self.top_p
                ),
            ));
        }
        if self.top_k == Some(0) {
            return Err(bad(
                "top_k",
                "must be at least 1 (or None to keep every token), got 0".into(),
            ));
        }
        if let Some(&t) = self.stop_tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(bad(
                "stop_tokens",
                format!("token {t} is outside the vocabulary of {vocab}"),
            ));
        }
        Ok(())
    }

    /// Whether `token` ends the sample.
    pub fn stops_at(&self, token: u32) -> bool {
        self.stop_tokens.contains(&token)
    }
}

/// One rollout request: a prompt and how to continue it.
///
/// ```
/// use lifecycle_decoder::{Request, SamplingParams};
/// let r = Request::new(vec![1, 2, 3], SamplingParams::new(16));
/// assert!(r.check(100).is_ok());
/// let e = Request::new(vec![], SamplingParams::new(16)).check(100).unwrap_err();
/// assert!(e.to_string().contains("prompt"), "{e}");
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The prompt's tokens (at least one).
    pub prompt: Vec<u32>,
    /// How to sample its continuation.
    pub params: SamplingParams,
}

impl Request {
    /// A request for `prompt` sampled as `params` says.
    pub fn new(prompt: Vec<u32>, params: SamplingParams) -> Self {
        Request { prompt, params }
    }

    /// Checks the prompt's tokens and the sampling settings against a vocabulary of `vocab`.
    pub fn check(&self, vocab: usize) -> Result<(), DecodeError> {
        if self.prompt.is_empty() {
            return Err(DecodeError::Request {
                request: None,
                field: "prompt",
                problem: "is empty: a request needs at least one prompt token".into(),
            });
        }
        if let Some(&t) = self.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(DecodeError::Request {
                request: None,
                field: "prompt",
                problem: format!("token {t} is outside the vocabulary of {vocab}"),
            });
        }
        self.params.check(vocab)
    }

    /// Positions the request may hold in a KV cache: its prompt and every token it may sample
    /// (the last sampled token is never fed back, so one less).
    pub fn positions(&self) -> usize {
        self.prompt.len() + self.params.max_new_tokens.saturating_sub(1)
    }
}

/// Why a sample ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// It drew one of its stop tokens (the last token of its output).
    Stop,
    /// It reached its `max_new_tokens`.
    Length,
    /// It was aborted before either.
    Abort,
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        })
    }
}

/// What one request gave back: its tokens, each token's log-probabilities and why it ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The request's id (the order it was submitted in, from 0).
    pub id: u64,
    /// The sampled tokens.
    pub tokens: Vec<u32>,
    /// Per token, `log_softmax(logits / T)` at the request's temperature before top-k / top-p
    /// truncation (what a trainer recomputes for the importance ratio); at T = 0, of the
    /// logits themselves.
    pub logprobs: Vec<f32>,
    /// Per token, `log_softmax(logits)` (T = 1).
    pub raw_logprobs: Vec<f32>,
    /// Per token, the log-probability in the truncated, renormalised distribution the token
    /// was drawn from (0 for a greedy token).
    pub truncated_logprobs: Vec<f32>,
    /// Per token, the weight version it was sampled on (a partial rollout continued after an
    /// update spans several).
    pub versions: Vec<u64>,
    /// Why it ended.
    pub finish: FinishReason,
}
