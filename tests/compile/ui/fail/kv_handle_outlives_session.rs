// A value branded by a view (a KV handle of one session) cannot outlive the session: the session
// cannot end while it lives (E0505), so it cannot reach the training update after it, and it
// cannot leave the block that holds the session (E0597).
use lifecycle_core::Lifecycle;

include!("../copying.rs");

fn across_update(lc: &mut Lifecycle<Copying>) -> LcResult {
    let session = lc.rollout()?;
    let kv = session.weights().brand(vec![0.5_f32; 4]);
    session.finish()?;
    lc.train()?.state_mut()[0] = 3.0;
    println!("{}", kv[0]);
    Ok(())
}

fn out_of_its_session(lc: &mut Lifecycle<Copying>) -> LcResult {
    let kv = {
        let session = lc.rollout()?;
        session.weights().brand(vec![0.5_f32; 4])
    };
    println!("{}", kv[0]);
    Ok(())
}

fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
    across_update(&mut lc)?;
    out_of_its_session(&mut lc)
}
