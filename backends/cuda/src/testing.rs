//! Helpers for tests that need GPUs, shared by every GPU test of the workspace.
//!
//! A GPU test never passes without testing: one that needs `n` GPUs starts with
//! [`require_gpus`]`(n)?` and **fails** with "needs n GPUs, found m" on a machine with fewer
//! (or with no driver), instead of printing a note and passing. GPU tests are marked
//! `#[ignore = "needs an NVIDIA GPU"]`, so machines without GPUs report them as ignored; on a
//! GPU machine they run with `--ignored`.
//!
//! ```
//! use lifecycle_cuda::testing::require_gpus;
//!
//! fn a_two_gpu_test() -> Result<(), Box<dyn std::error::Error>> {
//!     let found = require_gpus(2)?; // fails here on a machine with fewer than 2 GPUs
//!     assert!(found >= 2);
//!     Ok(())
//! }
//! match a_two_gpu_test() {
//!     Ok(()) => {}
//!     Err(e) => assert!(e.to_string().starts_with("needs 2 GPUs, found")),
//! }
//! ```

use crate::{device_count, CudaError, RankPlacement};

/// A test needs more GPUs than the machine shows. Its `Debug` form is its message, so a test
/// that returns it prints "Error: needs 2 GPUs, found 1: ...".
#[derive(Clone, PartialEq, Eq)]
pub struct NeedsGpus {
    /// GPUs the test needs.
    pub needed: usize,
    /// GPUs the driver reports (0 without a driver).
    pub found: usize,
    /// Why none were found, when the driver could not say (no driver, a driver error).
    pub cause: Option<String>,
}

impl std::fmt::Display for NeedsGpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gpus = if self.needed == 1 { "GPU" } else { "GPUs" };
        write!(f, "needs {} {gpus}, found {}", self.needed, self.found)?;
        match &self.cause {
            Some(cause) => write!(f, ": {cause}"),
            None => write!(
                f,
                ": run it on a machine with at least {} visible NVIDIA {gpus} (check \
                 `nvidia-smi` and CUDA_VISIBLE_DEVICES)",
                self.needed
            ),
        }
    }
}

impl std::fmt::Debug for NeedsGpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for NeedsGpus {}

/// The GPUs this machine shows, when there are at least `n`; [`NeedsGpus`] otherwise, also when
/// the CUDA driver is missing (found 0, with the driver's error as the cause).
///
/// ```
/// // Never panics: a count, or the reason the test cannot run.
/// match lifecycle_cuda::testing::require_gpus(1) {
///     Ok(found) => assert!(found >= 1),
///     Err(e) => assert!(e.to_string().starts_with("needs 1 GPU, found")),
/// }
/// ```
pub fn require_gpus(n: usize) -> Result<usize, NeedsGpus> {
    enough(n, device_count())
}

/// The decision of [`require_gpus`] from the driver's answer.
fn enough(n: usize, count: Result<usize, CudaError>) -> Result<usize, NeedsGpus> {
    match count {
        Ok(found) if found >= n => Ok(found),
        Ok(found) => Err(NeedsGpus {
            needed: n,
            found,
            cause: None,
        }),
        Err(e) => Err(NeedsGpus {
            needed: n,
            found: 0,
            cause: Some(e.to_string()),
        }),
    }
}

/// `world` ranks over the GPUs this machine shows: one rank per GPU where there are enough
/// ([`RankPlacement::one_per_gpu`]), otherwise dealt in turn over all of them
/// ([`RankPlacement::round_robin`], so ranks share GPUs). Needs one GPU ([`require_gpus`]).
///
/// For tests whose subject is the multi-rank logic, not the links: on a machine with fewer GPUs
/// than `world` the pool has no NCCL (see [`ThreadRankPool`](crate::ThreadRankPool)). A `world`
/// of 0 is an error too (its cause says so).
///
/// ```
/// match lifecycle_cuda::testing::spread(3) {
///     Ok(p) => assert_eq!(p.world(), 3),
///     Err(e) => assert!(e.to_string().starts_with("needs 1 GPU, found 0")),
/// }
/// ```
pub fn spread(world: usize) -> Result<RankPlacement, NeedsGpus> {
    let found = require_gpus(1)?;
    spread_over(world, found)
}

/// The placement of [`spread`] on a machine with `found` GPUs.
fn spread_over(world: usize, found: usize) -> Result<RankPlacement, NeedsGpus> {
    // `world = 0` fails in the placement (ZeroWorld), reported as the cause.
    RankPlacement::round_robin(world, found.min(world).max(1)).map_err(|e| NeedsGpus {
        needed: 1,
        found,
        cause: Some(e.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enough_gpus_give_the_count() {
        assert_eq!(enough(1, Ok(1)), Ok(1));
        assert_eq!(enough(2, Ok(8)), Ok(8));
        assert_eq!(enough(0, Ok(0)), Ok(0));
    }

    #[test]
    fn too_few_gpus_fail_saying_how_many() {
        let e = enough(2, Ok(1)).unwrap_err();
        assert_eq!((e.needed, e.found), (2, 1));
        let msg = e.to_string();
        assert!(msg.starts_with("needs 2 GPUs, found 1: "), "{msg}");
        assert!(msg.contains("CUDA_VISIBLE_DEVICES"), "{msg}");
        // What a failing test prints (`Error: {:?}`) is the message itself.
        assert_eq!(format!("{e:?}"), msg);
        let one = enough(1, Ok(0)).unwrap_err().to_string();
        assert!(one.starts_with("needs 1 GPU, found 0: "), "{one}");
    }

    #[test]
    fn no_driver_is_zero_gpus_with_the_reason() {
        let e = enough(4, Err(CudaError::NoDriver)).unwrap_err();
        assert_eq!((e.needed, e.found), (4, 0));
        let msg = e.to_string();
        assert!(
            msg.starts_with("needs 4 GPUs, found 0: the CUDA driver library"),
            "{msg}"
        );
        assert!(msg.contains("LD_LIBRARY_PATH"), "{msg}");
    }

    #[test]
    fn require_gpus_agrees_with_the_driver() {
        match (device_count(), require_gpus(1)) {
            (Ok(n), Ok(m)) => assert!(n == m && n >= 1),
            (Ok(0), Err(e)) => assert_eq!((e.found, e.cause), (0, None)),
            (Err(_), Err(e)) => assert!(e.found == 0 && e.cause.is_some()),
            (count, got) => panic!("driver says {count:?}, require_gpus(1) {got:?}"),
        }
    }

    #[test]
    fn spreading_shares_gpus_only_when_too_few() {
        let d = |w, found| spread_over(w, found).unwrap().devices().to_vec();
        assert_eq!(d(1, 1), [0]);
        assert_eq!(d(3, 1), [0, 0, 0]);
        assert_eq!(d(2, 2), [0, 1]);
        assert_eq!(d(2, 8), [0, 1]);
        assert_eq!(d(4, 2), [0, 1, 0, 1]);
        assert_eq!(d(3, 2), [0, 1, 0]);
        assert!(spread_over(2, 8).unwrap().shared_gpu().is_none());
        assert!(spread_over(3, 2).unwrap().shared_gpu().is_some());
        let e = spread_over(0, 1).unwrap_err();
        assert!(e.to_string().contains("at least 1"), "{e}");
    }
}
