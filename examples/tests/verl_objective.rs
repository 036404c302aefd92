//! The update's objectives against torch on shared inputs: `fixtures/verl_loss_inputs.json`
//! (groups of rewards, per-token `logp` / `old_logp` pairs; made by
//! `scripts/oracles/verl_loss_inputs.py`) and `fixtures/verl_loss_torch.json`, what
//! `scripts/oracles/verl_loss.py` computes from them in torch (float64, CPU): verl's GRPO
//! advantages and vanilla token-mean policy loss, the population variant, and the gradient of
//! each loss with respect to every token's `logp` by autograd.
//!
//! Tolerance: the Rust objective runs in f32 on inputs that are exact in f32 (multiples of
//! 1/256), so every figure must agree with torch's float64 within 1e-5 relative
//! (`|ours − torch| ≤ 1e-5 · max(|ours|, |torch|)`); a figure that is 0 in torch (the gradient
//! where a clip or the clamp binds, the advantages of equal rewards) must be 0 here.
//!
//! Until `verl_loss_torch.json` exists the comparisons fail and say how to make it.

use std::path::{Path, PathBuf};

use lifecycle_examples::dapo::update::{
    group_advantages, surrogate, token_objective, Objective, UpdateConfig, LOG_RATIO_CLAMP,
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
}

impl Inputs {
    fn read(v: &Value, objective: Objective) -> Inputs {
        let num = |k: &str| v.get(k).num() as f32;
        let config = UpdateConfig {
            objective,
            clip_low: num("clip_low"),
            clip_high: num("clip_high"),
            clip_ratio_c: num("clip_ratio_c"),
            adv_eps: num("adv_eps"),
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
        }
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

    fn finish(self, objective: Objective) {
        assert!(
            self.bad.is_empty(),
            "{objective}: {} of {} figures differ from torch by more than {REL} relative; the \
             first ones:\n{}",
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
/// torch reference's `objectives.<name>`.
fn compare_with_torch(objective: Objective) {
    let torch = torch_reference();
    let raw = inputs();
    assert!(
        torch.get("inputs") == &raw,
        "verl_loss_torch.json was made from other inputs than verl_loss_inputs.json: make it \
         again with `{MAKE_TORCH}`"
    );
    assert_eq!(torch.get("dtype").str(), "float64");
    let input = Inputs::read(&raw, objective);
    let want = torch.get("objectives").get(&objective.to_string());
    let mut cmp = Compare::default();

    let advantages = input.advantages();
    let torch_adv = want.get("advantages").array();
    assert_eq!(advantages.len(), torch_adv.len(), "groups");
    for (g, (a, t)) in advantages.iter().zip(torch_adv).enumerate() {
        cmp.all(&format!("advantages of group {g}"), a, &f64s(t));
    }

    let seq_adv = input.sequence_advantages(&advantages);
    let (torch_ratio, torch_loss) = (want.get("ratio").array(), want.get("token_loss").array());
    for (k, ((lp, olp), &adv)) in input
        .logp
        .iter()
        .zip(&input.old_logp)
        .zip(&seq_adv)
        .enumerate()
    {
        let tokens: Vec<_> = lp
            .iter()
            .zip(olp)
            .map(|(&l, &o)| token_objective(l, o, adv, &input.config))
            .collect();
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
    eprintln!(
        "{objective}: {} figures agree with torch within {REL} relative ({})",
        cmp.checked,
        torch.get("verl_check").str()
    );
    cmp.finish(objective);
}

#[test]
fn verl_objective_matches_torch() {
    compare_with_torch(Objective::Verl);
}

#[test]
fn population_objective_matches_torch() {
    compare_with_torch(Objective::Population);
}

/// The inputs are the loop's settings and meet every branch of verl's objective, away from its
/// kinks (where torch splits a gradient and a rounding could pick the other branch).
#[test]
fn the_shared_inputs_cover_every_branch_of_verl_objective() {
    let raw = inputs();
    let input = Inputs::read(&raw, Objective::Verl);
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
