//! The toy policy's training side: a single-device f32 forward over the full master tensors that
//! computes the same function as the tensor-parallel rollout forward ([`super::TpGroup`]), and
//! its backward pass (backpropagation through time over the recurrent state).
//!
//! Sequences of one forward pass run in lockstep (one row each in every product), so each weight
//! row is read once per token position for the whole batch. Everything here is sequential: the
//! caller spreads independent batches over threads and sums their gradients in a fixed order.

use lifecycle_host::{HostError, HostTrainState};
use lifecycle_layout::HostTensor;

use super::PolicyConfig;

/// RMSNorm's epsilon (the rollout forward's).
const NORM_EPS: f32 = 1e-6;
/// Weight of the previous step's hidden state in the next step's input (the recurrent mix).
const MIX: f32 = 0.5;

/// Full f32 tensors of the toy policy, in [`PolicyConfig::specs`] order: the master weights, or
/// gradients of the same shapes.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    config: PolicyConfig,
    tensors: Vec<Vec<f32>>,
}

impl Params {
    /// Zeros of every tensor (a gradient accumulator).
    pub fn zeros(config: PolicyConfig) -> Self {
        let tensors = config
            .specs()
            .iter()
            .map(|s| vec![0.0; s.numel()])
            .collect();
        Params { config, tensors }
    }

    /// The tensors of `tensors` (any float dtype), by name; every tensor of the policy must be
    /// there with its shape.
    pub fn from_tensors(config: PolicyConfig, tensors: &[HostTensor]) -> Result<Self, HostError> {
        let tensors = config
            .specs()
            .iter()
            .map(|spec| {
                let t = tensors
                    .iter()
                    .find(|t| t.name == spec.name)
                    .ok_or_else(|| HostError::UnknownTensor {
                        name: spec.name.clone(),
                    })?;
                let data = t.data.to_f32().ok_or_else(|| HostError::DType {
                    name: t.name.clone(),
                    found: t.data.dtype(),
                })?;
                check_len(&spec.name, &spec.shape, data.len())?;
                Ok(data)
            })
            .collect::<Result<_, HostError>>()?;
        Ok(Params { config, tensors })
    }

    /// The full fp32 master tensors of `state` ([`HostTrainState::full_master`]), by name.
    pub fn from_state(config: PolicyConfig, state: &HostTrainState) -> Result<Self, HostError> {
        let tensors = config
            .specs()
            .iter()
            .map(|spec| {
                let data = state.full_master(&spec.name)?;
                check_len(&spec.name, &spec.shape, data.len())?;
                Ok(data)
            })
            .collect::<Result<_, HostError>>()?;
        Ok(Params { config, tensors })
    }

    /// The policy sizes.
    pub fn config(&self) -> PolicyConfig {
        self.config
    }

    /// Every tensor, in [`PolicyConfig::specs`] order.
    pub fn tensors(&self) -> &[Vec<f32>] {
        &self.tensors
    }

    /// Every tensor, mutable (same order).
    pub fn tensors_mut(&mut self) -> &mut [Vec<f32>] {
        &mut self.tensors
    }

    /// Adds `other` element by element (the same sizes).
    pub fn add_assign(&mut self, other: &Params) {
        for (a, b) in self.tensors.iter_mut().zip(&other.tensors) {
            a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        }
    }

    /// The Euclidean norm over every element (summed in a fixed order).
    pub fn norm(&self) -> f32 {
        self.tensors
            .iter()
            .flatten()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum::<f64>()
            .sqrt() as f32
    }

    fn embed(&self) -> &[f32] {
        &self.tensors[0]
    }
    fn layer_norm(&self, l: usize) -> &[f32] {
        &self.tensors[1 + 3 * l]
    }
    fn up(&self, l: usize) -> &[f32] {
        &self.tensors[2 + 3 * l]
    }
    fn down(&self, l: usize) -> &[f32] {
        &self.tensors[3 + 3 * l]
    }
    fn final_norm(&self) -> &[f32] {
        &self.tensors[1 + 3 * self.config.layers]
    }
    fn head(&self) -> &[f32] {
        &self.tensors[2 + 3 * self.config.layers]
    }
}

fn check_len(name: &str, shape: &[usize], found: usize) -> Result<(), HostError> {
    let expected: usize = shape.iter().product();
    if found == expected {
        Ok(())
    } else {
        Err(HostError::ElementCount {
            name: name.to_string(),
            shape: shape.to_vec(),
            expected,
            found,
        })
    }
}

/// One scored sequence: the prompt, then the completion whose tokens are scored (each one's
/// log-probability given everything before it).
#[derive(Debug, Clone, Copy)]
pub struct Sequence<'a> {
    /// Prompt tokens (taken modulo the vocabulary, as the rollout does).
    pub prompt: &'a [usize],
    /// Generated tokens.
    pub completion: &'a [usize],
}

/// Why a forward pass cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForwardError {
    /// The sequences of one lockstep pass differ in prompt or completion length.
    #[error(
        "sequence {index} has a {prompt}-token prompt and a {completion}-token completion, the \
         first one {first_prompt} and {first_completion}: one forward pass needs equal lengths"
    )]
    Ragged {
        /// The sequence.
        index: usize,
        /// Its prompt length.
        prompt: usize,
        /// Its completion length.
        completion: usize,
        /// The first sequence's prompt length.
        first_prompt: usize,
        /// The first sequence's completion length.
        first_completion: usize,
    },
    /// A sequence with nothing to score.
    #[error("every sequence needs at least one prompt token and one completion token")]
    Empty,
    /// A completion token outside the vocabulary.
    #[error("completion token {token} is outside the vocabulary of {vocab}")]
    Token {
        /// The token.
        token: usize,
        /// The vocabulary size.
        vocab: usize,
    },
}

/// What one token position keeps for the backward pass (`B` sequences in lockstep).
#[derive(Debug, Clone)]
struct StepCache {
    /// Input token of each sequence.
    tokens: Vec<usize>,
    /// `x_0 .. x_L`: the residual stream before each block and after the last (`(L+1) × B × h`).
    x: Vec<f32>,
    /// Inverse RMS of `x_l` per block and sequence (`L × B`).
    inv: Vec<f32>,
    /// Normalised block inputs (`L × B × h`).
    normed: Vec<f32>,
    /// ReLU outputs (`L × B × f`).
    act: Vec<f32>,
    /// Inverse RMS of `x_L` (`B`).
    inv_final: Vec<f32>,
    /// Final normalised hidden state (`B × h`).
    head_in: Vec<f32>,
    /// Softmax of the tempered logits (`B × V`) where this position is scored, else empty.
    probs: Vec<f32>,
}

/// The forward pass of `B` sequences: their log-probabilities and what the backward pass needs.
#[derive(Debug, Clone)]
pub struct Forward {
    batch: usize,
    prompt_len: usize,
    temperature: f32,
    /// The scored token of each sequence per completion position (`n × B`).
    targets: Vec<usize>,
    steps: Vec<StepCache>,
    logprobs: Vec<Vec<f32>>,
}

impl Forward {
    /// Log-probability of every completion token, per sequence.
    pub fn logprobs(&self) -> &[Vec<f32>] {
        &self.logprobs
    }
}

/// `out[b × rows + o] = w[o] · x[b]` for `B` inputs of `cols` values (a linear layer without
/// bias on `B` rows; each weight row is read once).
fn linear(w: &[f32], x: &[f32], cols: usize, out: &mut [f32]) {
    let rows = w.len() / cols;
    let batch = x.len() / cols;
    for (o, wr) in w.chunks_exact(cols).enumerate() {
        for b in 0..batch {
            out[b * rows + o] = dot(wr, &x[b * cols..(b + 1) * cols]);
        }
    }
}

/// `dx[b] += Σ_o dy[b × rows + o] · w[o]`: the input gradient of [`linear`].
fn linear_input_grad(w: &[f32], dy: &[f32], cols: usize, dx: &mut [f32]) {
    let rows = w.len() / cols;
    let batch = dy.len() / rows;
    for (o, wr) in w.chunks_exact(cols).enumerate() {
        for b in 0..batch {
            let g = dy[b * rows + o];
            if g != 0.0 {
                axpy(g, wr, &mut dx[b * cols..(b + 1) * cols]);
            }
        }
    }
}

/// `dw[o] += Σ_b dy[b × rows + o] · x[b]`: the weight gradient of [`linear`].
fn linear_weight_grad(dw: &mut [f32], dy: &[f32], x: &[f32], cols: usize) {
    let rows = dw.len() / cols;
    let batch = x.len() / cols;
    for (o, dwr) in dw.chunks_exact_mut(cols).enumerate() {
        for b in 0..batch {
            let g = dy[b * rows + o];
            if g != 0.0 {
                axpy(g, &x[b * cols..(b + 1) * cols], dwr);
            }
        }
    }
}

/// Dot product with eight partial sums (the order is fixed: deterministic).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

/// RMSNorm of `x` with gain `g` into `out`; returns the inverse RMS.
fn rms_norm(x: &[f32], g: &[f32], out: &mut [f32]) -> f32 {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + NORM_EPS).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(g) {
        *o = v * inv * w;
    }
    inv
}

/// Backward of [`rms_norm`]: adds the input gradient to `dx` and the gain gradient to `dg`.
fn rms_norm_grad(x: &[f32], inv: f32, g: &[f32], dy: &[f32], dx: &mut [f32], dg: &mut [f32]) {
    let n = x.len() as f32;
    let mut s = 0.0f32;
    for i in 0..x.len() {
        dg[i] += dy[i] * x[i] * inv;
        s += g[i] * dy[i] * x[i];
    }
    let k = inv * inv * inv * s / n;
    for i in 0..x.len() {
        dx[i] += inv * g[i] * dy[i] - k * x[i];
    }
}

impl Params {
    /// The forward pass of `seqs` in lockstep (equal prompt and completion lengths), with
    /// log-probabilities of the completion tokens under `softmax(logits / temperature)`
    /// (temperature 0, greedy sampling, scores at temperature 1).
    pub fn forward(
        &self,
        seqs: &[Sequence<'_>],
        temperature: f32,
    ) -> Result<Forward, ForwardError> {
        let c = self.config;
        let (h, f, v, layers) = (c.hidden, c.ffn, c.vocab, c.layers);
        let Some(first) = seqs.first() else {
            return Err(ForwardError::Empty);
        };
        let (p, n) = (first.prompt.len(), first.completion.len());
        if p == 0 || n == 0 {
            return Err(ForwardError::Empty);
        }
        for (index, s) in seqs.iter().enumerate() {
            if (s.prompt.len(), s.completion.len()) != (p, n) {
                return Err(ForwardError::Ragged {
                    index,
                    prompt: s.prompt.len(),
                    completion: s.completion.len(),
                    first_prompt: p,
                    first_completion: n,
                });
            }
            if let Some(&token) = s.completion.iter().find(|&&t| t >= v) {
                return Err(ForwardError::Token { token, vocab: v });
            }
        }
        let temperature = if temperature > 0.0 { temperature } else { 1.0 };
        let b = seqs.len();
        let mut targets = vec![0usize; n * b];
        for (i, s) in seqs.iter().enumerate() {
            for (j, &t) in s.completion.iter().enumerate() {
                targets[j * b + i] = t;
            }
        }
        let mut logprobs = vec![vec![0.0f32; n]; b];
        let mut steps = Vec::with_capacity(p + n - 1);
        let mut state = vec![0.0f32; b * h];
        let mut pre = vec![0.0f32; b * f];
        let mut y = vec![0.0f32; b * h];
        let mut logits = vec![0.0f32; b * v];
        for t in 0..p + n - 1 {
            let tokens: Vec<usize> = seqs
                .iter()
                .map(|s| {
                    if t < p {
                        s.prompt[t] % v
                    } else {
                        s.completion[t - p]
                    }
                })
                .collect();
            let mut x = vec![0.0f32; (layers + 1) * b * h];
            for (i, &tok) in tokens.iter().enumerate() {
                let emb = &self.embed()[tok * h..(tok + 1) * h];
                let row = &mut x[i * h..(i + 1) * h];
                for ((o, e), s) in row.iter_mut().zip(emb).zip(&state[i * h..(i + 1) * h]) {
                    *o = e + MIX * s;
                }
            }
            let mut inv = vec![0.0f32; layers * b];
            let mut normed = vec![0.0f32; layers * b * h];
            let mut act = vec![0.0f32; layers * b * f];
            for l in 0..layers {
                let (before, after) = x.split_at_mut((l + 1) * b * h);
                let xl = &before[l * b * h..];
                let nl = &mut normed[l * b * h..(l + 1) * b * h];
                for i in 0..b {
                    inv[l * b + i] = rms_norm(
                        &xl[i * h..(i + 1) * h],
                        self.layer_norm(l),
                        &mut nl[i * h..(i + 1) * h],
                    );
                }
                linear(self.up(l), nl, h, &mut pre);
                let al = &mut act[l * b * f..(l + 1) * b * f];
                for (a, u) in al.iter_mut().zip(&pre) {
                    *a = u.max(0.0);
                }
                linear(self.down(l), al, f, &mut y);
                let next = &mut after[..b * h];
                for ((o, a), d) in next.iter_mut().zip(xl).zip(&y) {
                    *o = a + d;
                }
            }
            let last = &x[layers * b * h..];
            state.copy_from_slice(last);
            let mut step = StepCache {
                tokens,
                inv,
                normed,
                act,
                inv_final: Vec::new(),
                head_in: Vec::new(),
                probs: Vec::new(),
                x: Vec::new(),
            };
            if t + 1 >= p {
                // this position predicts completion token j
                let j = t + 1 - p;
                let mut head_in = vec![0.0f32; b * h];
                let mut inv_final = vec![0.0f32; b];
                for i in 0..b {
                    inv_final[i] = rms_norm(
                        &last[i * h..(i + 1) * h],
                        self.final_norm(),
                        &mut head_in[i * h..(i + 1) * h],
                    );
                }
                linear(self.head(), &head_in, h, &mut logits);
                let mut probs = vec![0.0f32; b * v];
                for i in 0..b {
                    let z = &logits[i * v..(i + 1) * v];
                    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max) / temperature;
                    let mut total = 0.0f32;
                    let pr = &mut probs[i * v..(i + 1) * v];
                    for (q, &zl) in pr.iter_mut().zip(z) {
                        *q = (zl / temperature - max).exp();
                        total += *q;
                    }
                    let lse = max + total.ln();
                    pr.iter_mut().for_each(|q| *q /= total);
                    logprobs[i][j] = z[targets[j * b + i]] / temperature - lse;
                }
                step.head_in = head_in;
                step.inv_final = inv_final;
                step.probs = probs;
            }
            step.x = x;
            steps.push(step);
        }
        Ok(Forward {
            batch: b,
            prompt_len: p,
            temperature,
            targets,
            steps,
            logprobs,
        })
    }

    /// Backpropagates `dlogp` (the loss's derivative with respect to each completion token's
    /// log-probability, per sequence, shaped like [`Forward::logprobs`]) through `fwd` (a
    /// forward pass of these parameters) and adds the parameter gradients to `grads`.
    pub fn backward(&self, fwd: &Forward, dlogp: &[Vec<f32>], grads: &mut Params) {
        let c = self.config;
        let (h, f, v, layers) = (c.hidden, c.ffn, c.vocab, c.layers);
        let b = fwd.batch;
        let (embed_i, final_i, head_i) = (0, 1 + 3 * layers, 2 + 3 * layers);
        // gradient with respect to the residual stream after the last block (x_L) of this step,
        // carried back through the recurrent mix from the next step
        let mut carry = vec![0.0f32; b * h];
        let mut dx = vec![0.0f32; b * h];
        let mut dlogits = vec![0.0f32; b * v];
        let mut dhead = vec![0.0f32; b * h];
        let mut dact = vec![0.0f32; b * f];
        let mut dnormed = vec![0.0f32; b * h];
        for (t, step) in fwd.steps.iter().enumerate().rev() {
            dx.copy_from_slice(&carry);
            let last = &step.x[layers * b * h..];
            if !step.probs.is_empty() {
                let j = t + 1 - fwd.prompt_len;
                for i in 0..b {
                    let coef = dlogp.get(i).and_then(|d| d.get(j)).copied().unwrap_or(0.0);
                    let target = fwd.targets[j * b + i];
                    let row = &mut dlogits[i * v..(i + 1) * v];
                    for (k, (d, q)) in row.iter_mut().zip(&step.probs[i * v..]).enumerate() {
                        let onehot = if k == target { 1.0 } else { 0.0 };
                        *d = coef * (onehot - q) / fwd.temperature;
                    }
                }
                linear_weight_grad(&mut grads.tensors[head_i], &dlogits, &step.head_in, h);
                dhead.iter_mut().for_each(|d| *d = 0.0);
                linear_input_grad(self.head(), &dlogits, h, &mut dhead);
                for i in 0..b {
                    rms_norm_grad(
                        &last[i * h..(i + 1) * h],
                        step.inv_final[i],
                        self.final_norm(),
                        &dhead[i * h..(i + 1) * h],
                        &mut dx[i * h..(i + 1) * h],
                        &mut grads.tensors[final_i],
                    );
                }
            }
            for l in (0..layers).rev() {
                // x_{l+1} = x_l + down(relu(up(norm(x_l)))): dx is the gradient of x_{l+1}
                let act = &step.act[l * b * f..(l + 1) * b * f];
                linear_weight_grad(&mut grads.tensors[3 + 3 * l], &dx, act, f);
                dact.iter_mut().for_each(|d| *d = 0.0);
                linear_input_grad(self.down(l), &dx, f, &mut dact);
                for (d, a) in dact.iter_mut().zip(act) {
                    if *a <= 0.0 {
                        *d = 0.0;
                    }
                }
                let normed = &step.normed[l * b * h..(l + 1) * b * h];
                linear_weight_grad(&mut grads.tensors[2 + 3 * l], &dact, normed, h);
                dnormed.iter_mut().for_each(|d| *d = 0.0);
                linear_input_grad(self.up(l), &dact, h, &mut dnormed);
                let xl = &step.x[l * b * h..(l + 1) * b * h];
                for i in 0..b {
                    rms_norm_grad(
                        &xl[i * h..(i + 1) * h],
                        step.inv[l * b + i],
                        self.layer_norm(l),
                        &dnormed[i * h..(i + 1) * h],
                        &mut dx[i * h..(i + 1) * h],
                        &mut grads.tensors[1 + 3 * l],
                    );
                }
            }
            // x_0 = embed[token] + MIX · (x_L of the previous step)
            for (i, &tok) in step.tokens.iter().enumerate() {
                let row = &mut grads.tensors[embed_i][tok * h..(tok + 1) * h];
                axpy(1.0, &dx[i * h..(i + 1) * h], row);
            }
            for (c, d) in carry.iter_mut().zip(&dx) {
                *c = MIX * d;
            }
        }
    }
}
