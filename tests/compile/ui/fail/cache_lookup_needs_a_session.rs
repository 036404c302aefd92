// A versioned cache is looked up with a proof of the current version borrowed from a live
// session: a bare number is refused (E0277), and a stamp cannot be kept for a later version: the
// session cannot end while it lives (E0505).
use lifecycle_core::{Lifecycle, PrefixCache};

include!("../copying.rs");

fn bare_number(cache: &mut PrefixCache<u32, f32>) {
    let _ = cache.get(3_u64, &[1, 2][..]);
}

fn stamp_kept_across_update(lc: &mut Lifecycle<Copying>, cache: &mut PrefixCache<u32, f32>) -> LcResult {
    let session = lc.rollout()?;
    let stamp = session.weights().stamp();
    session.finish()?;
    lc.train()?.state_mut()[0] = 3.0;
    let _ = cache.get(stamp, &[1, 2][..]);
    Ok(())
}

fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
    let mut cache = PrefixCache::new();
    bare_number(&mut cache);
    stamp_kept_across_update(&mut lc, &mut cache)
}
