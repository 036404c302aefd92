//! The token pick against numpy (`fixtures/make_sampling_fixture.py`) on fixed logits: the kept
//! set exactly, the renormalised distribution to f64 rounding, the drawn token given the draw,
//! and the three log-probabilities.

use crate::common;

use lifecycle_decoder::{kept, pick, SamplingParams};

#[test]
fn top_k_top_p_and_the_draw_agree_with_numpy() {
    let refs = common::json("sampling/references.json");
    let cases = refs["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for (n, c) in cases.iter().enumerate() {
        let logits = common::floats(&c["logits"]);
        let mut params =
            SamplingParams::new(1).with_temperature(c["temperature"].as_f64().unwrap() as f32);
        params.top_p = c["top_p"].as_f64().unwrap() as f32;
        params.top_k = c["top_k"].as_u64().map(|k| k as u32);
        let u = c["uniform"].as_f64().unwrap() as f32;
        let got = pick(&logits, &params, u);
        assert_eq!(got.token, c["token"].as_u64().unwrap() as u32, "case {n}");
        for (field, v) in [
            ("logprob", got.logprob),
            ("raw_logprob", got.raw_logprob),
            ("truncated_logprob", got.truncated_logprob),
        ] {
            let want = c[field].as_f64().unwrap();
            assert!(
                (f64::from(v) - want).abs() <= 1e-6 * want.abs().max(1.0),
                "case {n}: {field} {v} vs numpy {want}"
            );
        }
        if params.greedy() {
            continue;
        }
        let k = kept(&logits, &params);
        let ids: Vec<u32> = k.iter().map(|k| k.0).collect();
        assert_eq!(ids, common::tokens(&c["kept"]), "case {n}: kept set");
        let probs = c["probs"].as_array().unwrap();
        for ((_, p), want) in k.iter().zip(probs) {
            let want = want.as_f64().unwrap();
            assert!((p - want).abs() <= 1e-12, "case {n}: {p} vs numpy {want}");
        }
    }
}
