//! [`SharedWatch`]: what a switch checks of a shared base (a LoRA model's frozen bf16 tensors the
//! rollout reads where the trainer keeps them, [`ModelBinding::with_shared`]) before every
//! rollout: that each tensor is where it was shared, and whether the trainer wrote it.
//!
//! [`ModelBinding::with_shared`]: crate::ModelBinding::with_shared

use crate::error::BridgeError;
use crate::gpu::version_items;

/// The shared tensors' names, and their versions and parameters' addresses as last seen.
///
/// ```
/// use lifecycle_bridge::SharedWatch;
/// let mut w = SharedWatch::new(vec!["a".into(), "b".into()]);
/// // the front's versions of each tensor, flattened (a tuple of two counters: 7 and 3)
/// let v = |a, b| vec![2, 2, 1, a, 1, b];
/// w.check(&v(7, 3), &[0x100, 0x200])?; // the first call records them
/// w.check(&v(7, 3), &[0x100, 0x200])?;
/// // `b` written: refused once by name, then read as written
/// let e = w.check(&v(7, 4), &[0x100, 0x200]).unwrap_err();
/// assert!(e.to_string().contains("`b`") && e.to_string().contains("written"), "{e}");
/// w.check(&v(7, 4), &[0x100, 0x200])?;
/// // `a` moved: refused at every call while it is elsewhere
/// for _ in 0..2 {
///     let e = w.check(&v(7, 4), &[0x900, 0x200]).unwrap_err();
///     assert!(e.to_string().contains("`a`") && e.to_string().contains("moved"), "{e}");
/// }
/// w.check(&v(7, 4), &[0x100, 0x200])?;
/// # Ok::<(), lifecycle_bridge::BridgeError>(())
/// ```
#[derive(Debug, Clone)]
pub struct SharedWatch {
    names: Vec<String>,
    /// Each tensor's versions (the front's flattened item) and address, once seen.
    seen: Option<Vec<(Vec<u64>, u64)>>,
}

impl SharedWatch {
    /// A watch over the shared tensors `names` (in the binding's order), nothing seen yet.
    pub fn new(names: Vec<String>) -> Self {
        SharedWatch { names, seen: None }
    }

    /// The shared tensors' names.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Checks the shared tensors before a rollout: `versions`, the front's tuple of each one's
    /// versions flattened as [`version_items`] reads it; `addresses[i]`, where the `i`-th
    /// one's parameter is now. The first call records them. Later: a tensor whose parameter
    /// is elsewhere is refused by name (at every call while it is: the engine reads the
    /// storage it was shared at, which the front keeps); tensors written since the last call
    /// are refused by name once, their versions recorded, so the next call reads them as
    /// written (the rollout reads them in place). A count or shape that does not fit the
    /// names is refused.
    pub fn check(&mut self, versions: &[u64], addresses: &[u64]) -> Result<(), BridgeError> {
        let n = self.names.len();
        let items = version_items(versions)
            .filter(|items| items.len() == n)
            .ok_or_else(|| {
                BridgeError::Config(format!(
                    "shared base: versions of {n} tensors expected (a tuple of one item each)"
                ))
            })?;
        if addresses.len() != n {
            return Err(BridgeError::Config(format!(
                "shared base: {} addresses for {n} tensors",
                addresses.len()
            )));
        }
        let now: Vec<(Vec<u64>, u64)> = items
            .iter()
            .zip(addresses)
            .map(|(v, &a)| (v.to_vec(), a))
            .collect();
        let Some(seen) = &mut self.seen else {
            self.seen = Some(now);
            return Ok(());
        };
        for (i, ((_, at), (_, was))) in now.iter().zip(seen.iter()).enumerate() {
            if at != was {
                return Err(BridgeError::tensor(
                    &self.names[i],
                    format!(
                        "the frozen bf16 base is read in place by the rollout, and its \
                         parameter moved (now at {at:#x}, shared at {was:#x}): keep the base's \
                         parameters where they were when the switch was built (no offload or \
                         .to() of the base), or build a new switch"
                    ),
                ));
            }
        }
        let written: Vec<usize> = (0..n).filter(|&i| now[i].0 != seen[i].0).collect();
        let Some(&first) = written.first() else {
            return Ok(());
        };
        for &i in &written {
            seen[i].0 = now[i].0.clone();
        }
        let more = match written.len() {
            1 => String::new(),
            k => format!(" (and {} more)", k - 1),
        };
        Err(BridgeError::tensor(
            &self.names[first],
            format!(
                "frozen (the LoRA base, read in place by the rollout) but written since the \
                 last rollout{more}: train the adapters (and the tensors trained beside them) \
                 alone; the next rollout reads the base as written"
            ),
        ))
    }
}
