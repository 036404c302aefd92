//! The update's objectives against torch on shared inputs: `fixtures/verl_loss_inputs.json`
//! (groups of rewards, per-token `logp` / `old_logp` / `rollout_logp` triples; made by
//! `scripts/oracles/verl_loss_inputs.py`) and `fixtures/verl_loss_torch.json`, what
//! `scripts/oracles/verl_loss.py` computes from them in torch (float64, CPU): verl's GRPO
//! advantages and vanilla token-mean policy loss, the population variant, verl's loss with
//! truncated importance sampling (`verl_tis`), and the gradient of each loss with respect to
//! every token's `logp` by autograd.
//!
//! Tolerance: the Rust objective runs in f32 on inputs that are exact in f32 (multiples of
//! 1/256), so every figure must agree with torch's float64 within 1e-5 relative
//! (`|ours − torch| ≤ 1e-5 · max(|ours|, |torch|)`); a figure that is 0 in torch (the gradient
//! where a clip or the clamp binds, the advantages of equal rewards) must be 0 here.
//!
//! The TIS members of the inputs (`tis_cap`, `tis_cases`, each sequence's `rollout_logp`) came
//! after the first torch reference: the `verl` and `population` comparisons check that the
//! reference was made from the inputs without them ([`without_tis`]), so a reference made before
//! or after they existed serves; `verl_tis` needs a reference made from the whole inputs. Until
//! `verl_loss_torch.json` exists, or while it has no `verl_tis` objective, the comparisons that
//! need it fail and say how to make it. [`tis_matches_an_independent_f64_computation`] checks
//! the TIS loss without torch meanwhile: verl's formulas written again here in f64, checked
//! against the torch reference's `verl` objective, times the weights.

use std::path::{Path, PathBuf};

use lifecycle_examples::dapo::update::{
    group_advantages, surrogate, tis_weight, token_objective, Objective, UpdateConfig,
    LOG_RATIO_CLAMP,
};

use json::Value;

/// Relative tolerance of f32 against torch's float64.
const REL: f64 = 1e-5;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

const MAKE_TORCH: &str = "python3 scripts/oracles/verl_loss.py --inputs \
     examples/tests/fixtures/verl_loss_inputs.json --out \
     examples/tests/fixtures/verl_loss_torch.json";

fn inputs() -> Value {
    let path = fixtures().join("verl_loss_inputs.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    json::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The members of the inputs that truncated importance sampling added.
const TIS_MEMBERS: [&str; 3] = ["tis_cap", "tis_cases", "rollout_logp"];

/// `v` without the TIS members ([`TIS_MEMBERS`]), at any depth: the inputs the `verl` and
/// `population` objectives are computed from.
fn without_tis(v: &Value) -> Value {
    match v {
        Value::Obj(members) => Value::Obj(
            members
                .iter()
                .filter(|(k, _)| !TIS_MEMBERS.contains(&k.as_str()))
                .map(|(k, x)| (k.clone(), without_tis(x)))
                .collect(),
        ),
        Value::Arr(items) => Value::Arr(items.iter().map(without_tis).collect()),
        other => other.clone(),
    }
}

fn torch_reference() -> Value {
    let path = fixtures().join("verl_loss_torch.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) => panic!(
            "the torch reference {} is missing ({e}): make it on a machine with torch, from the \
             repository root: `{MAKE_TORCH}` (see examples/tests/fixtures/README.md), then run \
             this test again",
            path.display()
        ),
    };
    json::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn f64s(v: &Value) -> Vec<f64> {
    v.array().iter().map(Value::num).collect()
}

fn f32s(v: &Value) -> Vec<f32> {
    f64s(v).into_iter().map(|x| x as f32).collect()
}

/// The shared inputs as the update sees them.
struct Inputs {
    config: UpdateConfig,
    /// Rewards per group.
    rewards: Vec<Vec<f32>>,
    /// `(group, sample)` of each sequence.
    owner: Vec<(usize, usize)>,
    logp: Vec<Vec<f32>>,
    old_logp: Vec<Vec<f32>>,
    /// The rollout's log-probabilities of the tokens.
    rollout_logp: Vec<Vec<f32>>,
}

impl Inputs {
    /// The inputs under `objective`, with truncated importance sampling at the inputs' cap when
    /// `tis` (else `tis_cap: None`).
    fn read(v: &Value, objective: Objective, tis: bool) -> Inputs {
        let num = |k: &str| v.get(k).num() as f32;
        let config = UpdateConfig {
            objective,
            clip_low: num("clip_low"),
            clip_high: num("clip_high"),
            clip_ratio_c: num("clip_ratio_c"),
            adv_eps: num("adv_eps"),
            tis_cap: tis.then(|| num("tis_cap")),
            ..UpdateConfig::default()
        };
        assert_eq!(num("log_ratio_clamp"), LOG_RATIO_CLAMP);
        let seqs = v.get("sequences").array();
        let index = |s: &Value, k: &str| s.get(k).num() as usize;
        Inputs {
            config,
            rewards: v
                .get("groups")
                .array()
                .iter()
                .map(|g| f32s(g.get("rewards")))
                .collect(),
            owner: seqs
                .iter()
                .map(|s| (index(s, "group"), index(s, "sample")))
                .collect(),
            logp: seqs.iter().map(|s| f32s(s.get("logp"))).collect(),
            old_logp: seqs.iter().map(|s| f32s(s.get("old_logp"))).collect(),
            rollout_logp: seqs.iter().map(|s| f32s(s.get("rollout_logp"))).collect(),
        }
    }

    /// The truncated importance weight of every token (1 without TIS).
    fn weights(&self) -> Vec<Vec<f32>> {
        self.old_logp
            .iter()
            .zip(&self.rollout_logp)
            .map(|(old, rollout)| {
                old.iter()
                    .zip(rollout)
                    .map(|(&o, &r)| self.config.tis_cap.map_or(1.0, |c| tis_weight(o, r, c)))
                    .collect()
            })
            .collect()
    }

    fn advantages(&self) -> Vec<Vec<f32>> {
        self.rewards
            .iter()
            .map(|r| group_advantages(r, self.config.adv_eps, self.config.objective))
            .collect()
    }

    /// The advantage of each sequence.
    fn sequence_advantages(&self, advantages: &[Vec<f32>]) -> Vec<f32> {
        self.owner.iter().map(|&(g, i)| advantages[g][i]).collect()
    }

    fn tokens(&self) -> usize {
        self.logp.iter().map(Vec::len).sum()
    }
}

/// Mismatches beyond [`REL`], counted, with the first few.
#[derive(Default)]
struct Compare {
    checked: usize,
    bad: Vec<String>,
}

impl Compare {
    fn one(&mut self, what: impl FnOnce() -> String, ours: f64, torch: f64) {
        self.checked += 1;
        if (ours - torch).abs() > REL * ours.abs().max(torch.abs()) || ours.is_nan() {
            self.bad
                .push(format!("{}: ours {ours:e}, torch {torch:e}", what()));
        }
    }

    fn all(&mut self, what: &str, ours: &[f32], torch: &[f64]) {
        assert_eq!(ours.len(), torch.len(), "{what}: lengths");
        for (i, (&a, &b)) in ours.iter().zip(torch).enumerate() {
            self.one(|| format!("{what}[{i}]"), f64::from(a), b);
        }
    }

    fn finish(self, what: &str) {
        assert!(
            self.bad.is_empty(),
            "{what}: {} of {} figures differ from torch by more than {REL} relative; the first \
             ones:\n{}",
            self.bad.len(),
            self.checked,
            self.bad
                .iter()
                .take(12)
                .cloned()
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// Our advantages, per-token ratios and losses, token-mean loss and its gradient against the
/// torch reference's `objectives.<name>`: `objective`, with truncated importance sampling when
/// `tis` (the reference's `verl_tis`, which must then be there).
fn compare_with_torch(objective: Objective, tis: bool) {
    let torch = torch_reference();
    let raw = inputs();
    let name = if tis {
        format!("{objective}_tis")
    } else {
        objective.to_string()
    };
    if tis {
        assert!(
            torch.get("objectives").find(&name).is_some(),
            "the torch reference has no `{name}` objective (it was made before truncated \
             importance sampling was added to the oracle): make it again on a machine with \
             torch, from the repository root: `{MAKE_TORCH}` (see \
             examples/tests/fixtures/README.md), then run this test again"
        );
        assert!(
            torch.get("inputs") == &raw,
            "verl_loss_torch.json was made from other inputs than verl_loss_inputs.json: make \
             it again with `{MAKE_TORCH}`"
        );
    } else {
        // the TIS members do not enter these objectives: a reference made before they existed
        // serves
        assert!(
            without_tis(torch.get("inputs")) == without_tis(&raw),
            "verl_loss_torch.json was made from other inputs than verl_loss_inputs.json: make it \
             again with `{MAKE_TORCH}`"
        );
    }
    assert_eq!(torch.get("dtype").str(), "float64");
    let input = Inputs::read(&raw, objective, tis);
    let want = torch.get("objectives").get(&name);
    let mut cmp = Compare::default();

    let advantages = input.advantages();
    let torch_adv = want.get("advantages").array();
    assert_eq!(advantages.len(), torch_adv.len(), "groups");
    for (g, (a, t)) in advantages.iter().zip(torch_adv).enumerate() {
        cmp.all(&format!("advantages of group {g}"), a, &f64s(t));
    }

    let seq_adv = input.sequence_advantages(&advantages);
    let weights = input.weights();
    let (torch_ratio, torch_loss) = (want.get("ratio").array(), want.get("token_loss").array());
    for (k, (((lp, olp), &adv), w)) in input
        .logp
        .iter()
        .zip(&input.old_logp)
        .zip(&seq_adv)
        .zip(&weights)
        .enumerate()
    {
        let tokens: Vec<_> = lp
            .iter()
            .zip(olp)
            .zip(w)
            .map(|((&l, &o), &w)| token_objective(l, o, adv, &input.config).weighted(w))
            .collect();
        if tis {
            let torch_w = want.get("tis_weight").array();
            cmp.all(
                &format!("TIS weight of sequence {k}"),
                w,
                &f64s(&torch_w[k]),
            );
        }
        let ratio: Vec<f32> = tokens.iter().map(|t| t.ratio).collect();
        let loss: Vec<f32> = tokens.iter().map(|t| -t.value).collect();
        cmp.all(
            &format!("ratio of sequence {k}"),
            &ratio,
            &f64s(&torch_ratio[k]),
        );
        cmp.all(
            &format!("token loss of sequence {k}"),
            &loss,
            &f64s(&torch_loss[k]),
        );
    }

    // the update's own path: one mini-batch of every sequence, the token mean over all tokens
    let s = surrogate(
        &input.logp,
        &input.old_logp,
        Some(&input.rollout_logp),
        &seq_adv,
        &input.config,
        input.tokens(),
    );
    cmp.one(|| "token-mean loss".into(), s.loss, want.get("loss").num());
    let torch_grad = want.get("dloss_dlogp").array();
    assert_eq!(s.dlogp.len(), torch_grad.len(), "sequences");
    for (k, (g, t)) in s.dlogp.iter().zip(torch_grad).enumerate() {
        cmp.all(&format!("dloss/dlogp of sequence {k}"), g, &f64s(t));
    }
    let check = if tis {
        torch
            .find("verl_tis_check")
            .map_or("verl's TIS check not recorded", Value::str)
    } else {
        torch.get("verl_check").str()
    };
    eprintln!(
        "{name}: {} figures agree with torch within {REL} relative ({check})",
        cmp.checked,
    );
    cmp.finish(&name);
}

#[test]
fn verl_objective_matches_torch() {
    compare_with_torch(Objective::Verl, false);
}

#[test]
fn population_objective_matches_torch() {
    compare_with_torch(Objective::Population, false);
}

#[test]
fn verl_objective_with_truncated_importance_sampling_matches_torch() {
    compare_with_torch(Objective::Verl, true);
}

/// The inputs are the loop's settings and meet every branch of verl's objective, away from its
/// kinks (where torch splits a gradient and a rounding could pick the other branch).
#[test]
fn the_shared_inputs_cover_every_branch_of_verl_objective() {
    let raw = inputs();
    let input = Inputs::read(&raw, Objective::Verl, false);
    let d = UpdateConfig::default();
    assert_eq!(
        (
            input.config.clip_low,
            input.config.clip_high,
            input.config.clip_ratio_c,
            input.config.adv_eps
        ),
        (d.clip_low, d.clip_high, d.clip_ratio_c, d.adv_eps),
        "the inputs use the update's default settings"
    );
    // every number is exact in f32: both sides start from the same values
    for s in raw.get("sequences").array() {
        for x in f64s(s.get("logp"))
            .into_iter()
            .chain(f64s(s.get("old_logp")))
            .chain(f64s(s.get("rollout_logp")))
        {
            assert_eq!(f64::from(x as f32), x, "{x} is not exact in f32");
        }
    }
    // one sequence per sample
    let mut owners = input.owner.clone();
    owners.sort_unstable();
    let every: Vec<(usize, usize)> = input
        .rewards
        .iter()
        .enumerate()
        .flat_map(|(g, r)| (0..r.len()).map(move |i| (g, i)))
        .collect();
    assert_eq!(owners, every, "one sequence per sample");
    assert!(input.rewards.iter().any(|r| r.len() == 1), "a group of one");
    assert!(
        input
            .rewards
            .iter()
            .any(|r| r.len() > 1 && r.iter().all(|&x| x == r[0])),
        "a group of equal rewards"
    );

    let c = &input.config;
    let (lo, hi, cap) = (1.0 - c.clip_low, 1.0 + c.clip_high, c.clip_ratio_c);
    let adv = input.advantages();
    let seq_adv = input.sequence_advantages(&adv);
    let mut seen = std::collections::BTreeSet::new();
    for ((lp, olp), &a) in input.logp.iter().zip(&input.old_logp).zip(&seq_adv) {
        for (&l, &o) in lp.iter().zip(olp) {
            let x = l - o;
            let rho = x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp();
            // away from the kinks
            for kink in [lo, hi, cap] {
                assert!((rho / kink - 1.0).abs() > 1e-2, "ratio {rho} near {kink}");
            }
            assert!(
                (x.abs() - LOG_RATIO_CLAMP).abs() > 0.1,
                "log-ratio {x} near ±20"
            );
            let sign = match a {
                a if a > 0.0 => "A > 0",
                a if a < 0.0 => "A < 0",
                _ => "A = 0",
            };
            let region = if x < -LOG_RATIO_CLAMP {
                "log-ratio below −20"
            } else if x > LOG_RATIO_CLAMP {
                "log-ratio above 20"
            } else if rho < lo {
                "ratio below 1 − ε_low"
            } else if rho <= hi {
                "ratio inside the clip range"
            } else if rho < cap {
                "ratio between 1 + ε_high and c"
            } else {
                "ratio above c"
            };
            seen.insert((sign, region));
        }
    }
    for sign in ["A > 0", "A < 0", "A = 0"] {
        for region in [
            "log-ratio below −20",
            "log-ratio above 20",
            "ratio below 1 − ε_low",
            "ratio inside the clip range",
            "ratio between 1 + ε_high and c",
            "ratio above c",
        ] {
            assert!(
                seen.contains(&(sign, region)),
                "no token with {sign}, {region}"
            );
        }
    }
}

/// The TIS cases: weights below 1, between 1 and the cap, and above it (truncated), for
/// positive, negative and zero advantages, away from the cap (where a rounding could truncate
/// or not); and truncated tokens where the gradient flows and where a clip removed it.
#[test]
fn the_shared_inputs_cover_every_case_of_truncated_importance_sampling() {
    let raw = inputs();
    let input = Inputs::read(&raw, Objective::Verl, true);
    let cap = input.config.tis_cap.expect("the inputs have a tis_cap");
    assert_eq!(
        Some(cap),
        UpdateConfig::default().tis_cap,
        "the inputs use the update's default cap"
    );
    let seq_adv = input.sequence_advantages(&input.advantages());
    let mut seen = std::collections::BTreeSet::new();
    for (k, &a) in seq_adv.iter().enumerate() {
        for j in 0..input.logp[k].len() {
            let (l, o, r) = (
                input.logp[k][j],
                input.old_logp[k][j],
                input.rollout_logp[k][j],
            );
            assert!(r <= 0.0, "rollout log-prob {r} > 0");
            let w = (f64::from(o) - f64::from(r)).exp();
            assert!(
                (w / f64::from(cap) - 1.0).abs() > 1e-2,
                "weight {w} near the cap"
            );
            let sign = match a {
                a if a > 0.0 => "A > 0",
                a if a < 0.0 => "A < 0",
                _ => "A = 0",
            };
            let region = if w < 1.0 {
                "w < 1"
            } else if w <= f64::from(cap) {
                "1 ≤ w ≤ C"
            } else {
                "w > C (truncated)"
            };
            seen.insert((sign, region, ""));
            if w > f64::from(cap) && a != 0.0 {
                let t = token_objective(l, o, a, &input.config);
                let grad = if t.clipped {
                    "gradient clipped"
                } else {
                    "gradient flows"
                };
                seen.insert((sign, region, grad));
            }
        }
    }
    for sign in ["A > 0", "A < 0", "A = 0"] {
        for region in ["w < 1", "1 ≤ w ≤ C", "w > C (truncated)"] {
            assert!(
                seen.contains(&(sign, region, "")),
                "no token with {sign}, {region}"
            );
        }
    }
    for sign in ["A > 0", "A < 0"] {
        for grad in ["gradient flows", "gradient clipped"] {
            assert!(
                seen.contains(&(sign, "w > C (truncated)", grad)),
                "no truncated token with {sign} and its {grad}"
            );
        }
    }
}

/// The inputs' settings as f64 (as torch reads them: `0.2f32` is not `0.2`).
struct Settings64 {
    clip_low: f64,
    clip_high: f64,
    clip_ratio_c: f64,
    adv_eps: f64,
    log_ratio_clamp: f64,
    tis_cap: f64,
}

impl Settings64 {
    fn read(v: &Value) -> Settings64 {
        let num = |k: &str| v.get(k).num();
        Settings64 {
            clip_low: num("clip_low"),
            clip_high: num("clip_high"),
            clip_ratio_c: num("clip_ratio_c"),
            adv_eps: num("adv_eps"),
            log_ratio_clamp: num("log_ratio_clamp"),
            tis_cap: num("tis_cap"),
        }
    }
}

/// verl's objective for one token, written again here in f64 from verl's
/// `compute_policy_loss_vanilla` (not from the crate's objective): the loss and its derivative
/// with respect to `logp`, both before the token mean, times the truncated importance weight
/// `min(exp(old − rollout), cap)` when `tis` is `Some(rollout)`.
fn verl_token_f64(logp: f64, old: f64, adv: f64, c: &Settings64, tis: Option<f64>) -> (f64, f64) {
    let clamp = c.log_ratio_clamp;
    let d = logp - old;
    let ratio = d.clamp(-clamp, clamp).exp();
    // torch.clamp passes the gradient where the input is inside the closed interval
    let dratio = if d.abs() <= clamp { ratio } else { 0.0 };
    let (lo, hi) = (1.0 - c.clip_low, 1.0 + c.clip_high);
    let pg1 = -adv * ratio;
    let pg2 = -adv * ratio.clamp(lo, hi);
    // the inputs have no ties: the larger term takes the whole gradient
    let (mut loss, mut grad) = if pg1 >= pg2 {
        (pg1, -adv * dratio)
    } else {
        (pg2, 0.0)
    };
    let pg3 = -adv * c.clip_ratio_c;
    if adv < 0.0 && pg3 < loss {
        (loss, grad) = (pg3, 0.0);
    }
    if let Some(rollout) = tis {
        let w = (old - rollout).exp().min(c.tis_cap);
        (loss, grad) = (loss * w, grad * w);
    }
    (loss, grad)
}

/// verl's advantages in f64 (`torch.std`'s Bessel correction; mean 0 and std 1 for a group of
/// one), written again here.
fn verl_advantages_f64(rewards: &[f64], eps: f64) -> Vec<f64> {
    let n = rewards.len() as f64;
    let (mean, std) = if rewards.len() == 1 {
        (0.0, 1.0)
    } else {
        let mean = rewards.iter().sum::<f64>() / n;
        let ss = rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>();
        (mean, (ss / (n - 1.0)).sqrt())
    };
    rewards.iter().map(|r| (r - mean) / (std + eps)).collect()
}

/// The TIS loss without torch: the f64 formulas above agree with the torch reference's `verl`
/// objective (so they are verl's), and the crate's f32 update with TIS agrees with them times
/// the weights, within [`REL`]. Runs whether or not the reference has `verl_tis` yet.
#[test]
fn tis_matches_an_independent_f64_computation() {
    let raw = inputs();
    let input = Inputs::read(&raw, Objective::Verl, true);
    let c = &input.config;
    let c64 = Settings64::read(&raw);
    let seqs = raw.get("sequences").array();
    let adv: Vec<Vec<f64>> = raw
        .get("groups")
        .array()
        .iter()
        .map(|g| verl_advantages_f64(&f64s(g.get("rewards")), c64.adv_eps))
        .collect();
    let n = input.tokens() as f64;
    // per sequence: (loss, dloss/dlogp) per token without and with TIS, token mean applied
    let eval = |tis: bool| -> (f64, Vec<Vec<f64>>, Vec<Vec<f64>>) {
        let (mut total, mut losses, mut grads) = (0.0, Vec::new(), Vec::new());
        for (s, &(g, i)) in seqs.iter().zip(&input.owner) {
            let (lp, old, rollout) = (
                f64s(s.get("logp")),
                f64s(s.get("old_logp")),
                f64s(s.get("rollout_logp")),
            );
            let (mut l, mut d) = (Vec::new(), Vec::new());
            for j in 0..lp.len() {
                let t = tis.then_some(rollout[j]);
                let (loss, grad) = verl_token_f64(lp[j], old[j], adv[g][i], &c64, t);
                total += loss;
                l.push(loss);
                d.push(grad / n);
            }
            losses.push(l);
            grads.push(d);
        }
        (total / n, losses, grads)
    };

    // the f64 formulas are verl's: they reproduce torch's `verl` objective
    let torch = torch_reference();
    assert!(
        without_tis(torch.get("inputs")) == without_tis(&raw),
        "verl_loss_torch.json was made from other inputs than verl_loss_inputs.json: make it \
         again with `{MAKE_TORCH}`"
    );
    let want = torch.get("objectives").get("verl");
    let (loss, losses, grads) = eval(false);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * a.abs().max(b.abs()) + 1e-300;
    assert!(
        close(loss, want.get("loss").num()),
        "f64 loss {loss} vs torch"
    );
    for (k, (l, d)) in losses.iter().zip(&grads).enumerate() {
        let (tl, td) = (
            f64s(&want.get("token_loss").array()[k]),
            f64s(&want.get("dloss_dlogp").array()[k]),
        );
        for j in 0..l.len() {
            assert!(
                close(l[j], tl[j]) && close(d[j], td[j]),
                "sequence {k} token {j}: f64 ({}, {}) vs torch ({}, {})",
                l[j],
                d[j],
                tl[j],
                td[j]
            );
        }
    }

    // the crate's update with TIS against the f64 formulas with TIS
    let (loss, losses, grads) = eval(true);
    let seq_adv = input.sequence_advantages(&input.advantages());
    let s = surrogate(
        &input.logp,
        &input.old_logp,
        Some(&input.rollout_logp),
        &seq_adv,
        c,
        input.tokens(),
    );
    let mut cmp = Compare::default();
    cmp.one(|| "token-mean loss".into(), s.loss, loss);
    for (k, (g, want)) in s.dlogp.iter().zip(&grads).enumerate() {
        cmp.all(&format!("dloss/dlogp of sequence {k}"), g, want);
    }
    let weights = input.weights();
    for (k, want) in losses.iter().enumerate() {
        let ours: Vec<f32> = (0..want.len())
            .map(|j| {
                let (l, o) = (input.logp[k][j], input.old_logp[k][j]);
                -token_objective(l, o, seq_adv[k], c)
                    .weighted(weights[k][j])
                    .value
            })
            .collect();
        cmp.all(&format!("token loss of sequence {k}"), &ours, want);
    }
    // TIS changed the loss: the weights are not all 1
    let (plain, _, _) = eval(false);
    assert!(
        (loss - plain).abs() > 1e-3 * plain.abs(),
        "{loss} vs {plain}"
    );
    eprintln!(
        "verl with TIS: {} figures agree with the f64 formulas within {REL} relative",
        cmp.checked
    );
    cmp.finish("verl_tis (f64)");
}

/// A small JSON reader for the fixtures (objects, arrays, numbers, strings, booleans, null).
mod json {
    /// A JSON value; objects keep their keys in file order.
    #[derive(Debug, Clone, PartialEq)]
    pub enum Value {
        Null,
        Bool(bool),
        Num(f64),
        Str(String),
        Arr(Vec<Value>),
        Obj(Vec<(String, Value)>),
    }

    impl Value {
        /// The member `key` of an object; panics with the key where there is none.
        pub fn get(&self, key: &str) -> &Value {
            match self {
                Value::Obj(members) => members
                    .iter()
                    .find(|(k, _)| k == key)
                    .map(|(_, v)| v)
                    .unwrap_or_else(|| panic!("no member `{key}` in the fixture")),
                other => panic!("expected an object with `{key}`, found {other:?}"),
            }
        }

        /// The member `key` of an object, if there is one.
        pub fn find(&self, key: &str) -> Option<&Value> {
            match self {
                Value::Obj(members) => members.iter().find(|(k, _)| k == key).map(|(_, v)| v),
                _ => None,
            }
        }

        /// The number; panics on anything else.
        pub fn num(&self) -> f64 {
            match self {
                Value::Num(x) => *x,
                other => panic!("expected a number, found {other:?}"),
            }
        }

        /// The string; panics on anything else.
        pub fn str(&self) -> &str {
            match self {
                Value::Str(s) => s,
                other => panic!("expected a string, found {other:?}"),
            }
        }

        /// The elements; panics on anything else.
        pub fn array(&self) -> &[Value] {
            match self {
                Value::Arr(a) => a,
                other => panic!("expected an array, found {other:?}"),
            }
        }
    }

    /// Parses one JSON document.
    pub fn parse(text: &str) -> Result<Value, String> {
        let mut p = Parser {
            s: text.as_bytes(),
            at: 0,
        };
        let v = p.value()?;
        p.ws();
        if p.at != p.s.len() {
            return Err(p.err("the end of the document"));
        }
        Ok(v)
    }

    struct Parser<'a> {
        s: &'a [u8],
        at: usize,
    }

    impl Parser<'_> {
        fn err(&self, expected: &str) -> String {
            format!("JSON: expected {expected} at byte {}", self.at)
        }

        fn ws(&mut self) {
            while self.s.get(self.at).is_some_and(|c| c.is_ascii_whitespace()) {
                self.at += 1;
            }
        }

        fn eat(&mut self, lit: &str) -> bool {
            let ok = self.s[self.at..].starts_with(lit.as_bytes());
            if ok {
                self.at += lit.len();
            }
            ok
        }

        fn value(&mut self) -> Result<Value, String> {
            self.ws();
            match self.s.get(self.at) {
                Some(b'{') => self.object(),
                Some(b'[') => self.array(),
                Some(b'"') => self.string().map(Value::Str),
                Some(b'-' | b'0'..=b'9') => self.number(),
                _ if self.eat("true") => Ok(Value::Bool(true)),
                _ if self.eat("false") => Ok(Value::Bool(false)),
                _ if self.eat("null") => Ok(Value::Null),
                _ => Err(self.err("a value")),
            }
        }

        fn object(&mut self) -> Result<Value, String> {
            self.at += 1;
            let mut members = Vec::new();
            self.ws();
            if self.eat("}") {
                return Ok(Value::Obj(members));
            }
            loop {
                self.ws();
                if self.s.get(self.at) != Some(&b'"') {
                    return Err(self.err("a key"));
                }
                let key = self.string()?;
                self.ws();
                if !self.eat(":") {
                    return Err(self.err("`:`"));
                }
                members.push((key, self.value()?));
                self.ws();
                if self.eat("}") {
                    return Ok(Value::Obj(members));
                }
                if !self.eat(",") {
                    return Err(self.err("`,` or `}`"));
                }
            }
        }

        fn array(&mut self) -> Result<Value, String> {
            self.at += 1;
            let mut items = Vec::new();
            self.ws();
            if self.eat("]") {
                return Ok(Value::Arr(items));
            }
            loop {
                items.push(self.value()?);
                self.ws();
                if self.eat("]") {
                    return Ok(Value::Arr(items));
                }
                if !self.eat(",") {
                    return Err(self.err("`,` or `]`"));
                }
            }
        }

        fn number(&mut self) -> Result<Value, String> {
            let start = self.at;
            while self
                .s
                .get(self.at)
                .is_some_and(|c| matches!(c, b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'))
            {
                self.at += 1;
            }
            let text = std::str::from_utf8(&self.s[start..self.at]).map_err(|e| e.to_string())?;
            text.parse::<f64>()
                .map(Value::Num)
                .map_err(|_| format!("JSON: `{text}` at byte {start} is not a number"))
        }

        fn hex4(&mut self) -> Result<u32, String> {
            let digits = self
                .s
                .get(self.at..self.at + 4)
                .and_then(|d| std::str::from_utf8(d).ok())
                .and_then(|d| u32::from_str_radix(d, 16).ok())
                .ok_or_else(|| self.err("four hex digits"))?;
            self.at += 4;
            Ok(digits)
        }

        fn string(&mut self) -> Result<String, String> {
            self.at += 1;
            let mut out = Vec::new();
            loop {
                let Some(&c) = self.s.get(self.at) else {
                    return Err(self.err("the end of a string"));
                };
                self.at += 1;
                match c {
                    b'"' => return String::from_utf8(out).map_err(|e| e.to_string()),
                    b'\\' => {
                        let Some(&e) = self.s.get(self.at) else {
                            return Err(self.err("an escape"));
                        };
                        self.at += 1;
                        let ch = match e {
                            b'"' => '"',
                            b'\\' => '\\',
                            b'/' => '/',
                            b'b' => '\u{8}',
                            b'f' => '\u{c}',
                            b'n' => '\n',
                            b'r' => '\r',
                            b't' => '\t',
                            b'u' => {
                                let hi = self.hex4()?;
                                let code = if (0xD800..0xDC00).contains(&hi) && self.eat("\\u") {
                                    let lo = self.hex4()?;
                                    0x10000 + ((hi - 0xD800) << 10) + lo.wrapping_sub(0xDC00)
                                } else {
                                    hi
                                };
                                char::from_u32(code).ok_or_else(|| self.err("a character"))?
                            }
                            _ => return Err(self.err("an escape")),
                        };
                        let mut buf = [0; 4];
                        out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                    }
                    _ => out.push(c),
                }
            }
        }
    }
}
