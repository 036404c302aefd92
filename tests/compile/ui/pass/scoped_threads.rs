// Scoped threads may read the view inside a session (and inside a rollout function's body).
use lifecycle_core::{sharded_rollout, Lifecycle, RolloutView};

include!("../copying.rs");

#[sharded_rollout]
fn parallel_sum(w: RolloutView<'_, Vec<f32>>, threads: usize) -> f32 {
    let chunk = w.len().div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = w
            .chunks(chunk)
            .map(|part| s.spawn(move || part.iter().sum::<f32>()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    })
}

pub fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, (1..=8).map(|x| x as f32).collect());
    let session = lc.rollout()?;
    let weights = session.weights();
    let total: f32 = std::thread::scope(|s| {
        let a = s.spawn(move || weights[..4].iter().sum::<f32>());
        let b = s.spawn(move || weights[4..].iter().sum::<f32>());
        a.join().unwrap() + b.join().unwrap()
    });
    session.finish()?;
    assert_eq!(total, 36.0);
    assert_eq!(parallel_sum(&mut lc, 3)?, 36.0);
    Ok(())
}
