// Methods with `&self` and `&mut self`; the entry points are associated functions of the type.
use lifecycle_core::{sharded_rollout, Lifecycle, RolloutView};

include!("../copying.rs");

struct Sampler<T> {
    temperature: T,
    calls: usize,
}

impl<T: Copy + Into<f32>> Sampler<T> {
    #[sharded_rollout]
    fn logit(&self, w: RolloutView<'_, Vec<f32>>, token: usize) -> f32 {
        w[token] / self.temperature.into()
    }

    #[sharded_rollout]
    fn count(&mut self, w: RolloutView<'_, Vec<f32>>) -> usize {
        self.calls += 1;
        w.len()
    }
}

pub fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 4.0]);
    let mut sampler = Sampler {
        temperature: 2u8,
        calls: 0,
    };
    assert_eq!(sampler.logit(&mut lc, 1)?, 2.0);
    assert_eq!(sampler.count(&mut lc)?, 2);
    assert_eq!(sampler.calls, 1);
    Sampler::<u8>::logit_exit(&mut lc)?;
    assert_eq!((lc.metrics().enters, lc.metrics().exits), (1, 1));
    Ok(())
}
