//! Where the ranks of a single-process pool run: rank `r` on GPU `devices[r]`.
//!
//! One rank per GPU is the usual placement ([`RankPlacement::one_per_gpu`]); a placement whose
//! GPUs repeat puts several ranks on one GPU ([`RankPlacement::on_devices`],
//! [`RankPlacement::shared`]), so the multi-rank logic of a backend runs on a machine with fewer
//! GPUs than ranks. NCCL refuses two ranks of one communicator on one GPU, so such a pool has no
//! NCCL communicators: its ranks move bytes with peer copies only (between ranks on one GPU they
//! are device-local copies), see [`Transport`](crate::Transport).

use crate::CudaError;

/// Two ranks of one pool placed on the same GPU: the first such pair of a [`RankPlacement`]
/// ([`RankPlacement::shared_gpu`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedGpu {
    /// The lower rank.
    pub first: usize,
    /// The higher rank, on the same GPU as `first`.
    pub second: usize,
    /// The GPU both run on.
    pub device: usize,
}

impl SharedGpu {
    /// The error every NCCL operation of a pool with this pair returns:
    /// [`CudaError::NcclNeedsOneGpuPerRank`].
    ///
    /// ```
    /// use lifecycle_cuda::RankPlacement;
    /// let shared = RankPlacement::on_devices(&[0, 1, 1])?.shared_gpu().expect("GPU 1 repeats");
    /// assert!(shared.nccl_error().to_string().contains(
    ///     "the NCCL transport needs one GPU per rank; this pool places ranks 1 and 2 on GPU 1"
    /// ));
    /// # Ok::<(), lifecycle_cuda::CudaError>(())
    /// ```
    pub fn nccl_error(&self) -> CudaError {
        CudaError::NcclNeedsOneGpuPerRank {
            first: self.first,
            second: self.second,
            device: self.device,
        }
    }
}

/// The GPU of every rank of a single-process pool ([`ThreadRankPool::with_placement`]): rank `r`
/// runs on GPU `devices()[r]`. GPUs may repeat: several ranks then share one GPU, each with its
/// own thread, streams and buffers, and the pool has no NCCL communicators.
///
/// ```
/// use lifecycle_cuda::{RankPlacement, SharedGpu};
///
/// let spread = RankPlacement::round_robin(4, 2)?;
/// assert_eq!(spread.devices(), &[0, 1, 0, 1]);
/// assert_eq!(spread.gpus_needed(), 2);
/// assert_eq!(
///     spread.shared_gpu(),
///     Some(SharedGpu { first: 0, second: 2, device: 0 })
/// );
/// assert_eq!(RankPlacement::one_per_gpu(3)?.shared_gpu(), None);
/// # Ok::<(), lifecycle_cuda::CudaError>(())
/// ```
///
/// [`ThreadRankPool::with_placement`]: crate::ThreadRankPool::with_placement
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPlacement {
    devices: Vec<usize>,
}

impl RankPlacement {
    /// Rank `r` on GPU `r`, for `r` in `0..world`. A world of zero is [`CudaError::ZeroWorld`].
    pub fn one_per_gpu(world: usize) -> Result<Self, CudaError> {
        Self::on_devices(&(0..world).collect::<Vec<_>>())
    }

    /// Rank `r` on GPU `devices[r]`; GPUs may repeat. No ranks is [`CudaError::ZeroWorld`].
    pub fn on_devices(devices: &[usize]) -> Result<Self, CudaError> {
        if devices.is_empty() {
            return Err(CudaError::ZeroWorld);
        }
        Ok(RankPlacement {
            devices: devices.to_vec(),
        })
    }

    /// All `world` ranks on GPU `device`.
    pub fn shared(world: usize, device: usize) -> Result<Self, CudaError> {
        Self::on_devices(&vec![device; world])
    }

    /// `world` ranks dealt over GPUs `0..gpus` in turn: rank `r` on GPU `r % gpus`. One rank per
    /// GPU when `gpus >= world` (then GPUs `0..world`), shared GPUs otherwise. No GPUs is
    /// [`CudaError::NoDevice`].
    pub fn round_robin(world: usize, gpus: usize) -> Result<Self, CudaError> {
        if gpus == 0 {
            return Err(CudaError::NoDevice {
                detail: "a placement over 0 GPUs".into(),
            });
        }
        Self::on_devices(&(0..world).map(|r| r % gpus).collect::<Vec<_>>())
    }

    /// W: the number of ranks.
    pub fn world(&self) -> usize {
        self.devices.len()
    }

    /// The GPU of every rank, by rank.
    pub fn devices(&self) -> &[usize] {
        &self.devices
    }

    /// GPUs the machine must show: the highest GPU index plus one.
    pub fn gpus_needed(&self) -> usize {
        self.devices.iter().max().map_or(0, |d| d + 1)
    }

    /// The first pair of ranks on one GPU (by the higher rank, then the lower), `None` when every
    /// rank has a GPU of its own.
    pub fn shared_gpu(&self) -> Option<SharedGpu> {
        self.devices.iter().enumerate().find_map(|(second, d)| {
            self.devices[..second]
                .iter()
                .position(|e| e == d)
                .map(|first| SharedGpu {
                    first,
                    second,
                    device: *d,
                })
        })
    }

    /// Checks the placement against the `visible` GPUs of the machine: every GPU index must be
    /// below `visible`. One rank per GPU on GPUs `0..W` with too few of them is
    /// [`CudaError::TooFewGpus`]; any other placement on a GPU that does not exist is
    /// [`CudaError::NoSuchGpu`] naming the first such rank.
    ///
    /// ```
    /// use lifecycle_cuda::{CudaError, RankPlacement};
    /// assert!(RankPlacement::shared(3, 0)?.check(1).is_ok());
    /// assert!(matches!(
    ///     RankPlacement::on_devices(&[0, 0, 2])?.check(2),
    ///     Err(CudaError::NoSuchGpu { rank: 2, device: 2, available: 2 })
    /// ));
    /// # Ok::<(), lifecycle_cuda::CudaError>(())
    /// ```
    pub fn check(&self, visible: usize) -> Result<(), CudaError> {
        let Some((rank, &device)) = self
            .devices
            .iter()
            .enumerate()
            .find(|(_, d)| **d >= visible)
        else {
            return Ok(());
        };
        if self.devices.iter().enumerate().all(|(r, d)| r == *d) {
            return Err(CudaError::TooFewGpus {
                requested: self.world(),
                available: visible,
            });
        }
        Err(CudaError::NoSuchGpu {
            rank,
            device,
            available: visible,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements_list_their_gpus() {
        assert_eq!(RankPlacement::one_per_gpu(3).unwrap().devices(), &[0, 1, 2]);
        assert_eq!(RankPlacement::shared(3, 1).unwrap().devices(), &[1, 1, 1]);
        assert_eq!(
            RankPlacement::round_robin(5, 2).unwrap().devices(),
            &[0, 1, 0, 1, 0]
        );
        assert_eq!(RankPlacement::round_robin(2, 8).unwrap().devices(), &[0, 1]);
        assert_eq!(RankPlacement::on_devices(&[3, 0]).unwrap().gpus_needed(), 4);
        assert_eq!(RankPlacement::shared(4, 0).unwrap().world(), 4);
    }

    #[test]
    fn empty_placements_and_no_gpus_are_errors() {
        assert!(matches!(
            RankPlacement::on_devices(&[]),
            Err(CudaError::ZeroWorld)
        ));
        assert!(matches!(
            RankPlacement::one_per_gpu(0),
            Err(CudaError::ZeroWorld)
        ));
        assert!(matches!(
            RankPlacement::shared(0, 0),
            Err(CudaError::ZeroWorld)
        ));
        assert!(matches!(
            RankPlacement::round_robin(2, 0),
            Err(CudaError::NoDevice { .. })
        ));
    }

    #[test]
    fn the_first_repeated_gpu_is_named() {
        let shared = |d: &[usize]| RankPlacement::on_devices(d).unwrap().shared_gpu();
        assert_eq!(shared(&[0]), None);
        assert_eq!(shared(&[1, 0, 2]), None);
        assert_eq!(
            shared(&[0, 0]),
            Some(SharedGpu {
                first: 0,
                second: 1,
                device: 0
            })
        );
        // The pair with the lowest second rank: ranks 1 and 2 on GPU 1, not 0 and 3 on GPU 0.
        assert_eq!(
            shared(&[0, 1, 1, 0]),
            Some(SharedGpu {
                first: 1,
                second: 2,
                device: 1
            })
        );
        assert_eq!(
            shared(&[2, 0, 1, 2]),
            Some(SharedGpu {
                first: 0,
                second: 3,
                device: 2
            })
        );
    }

    #[test]
    fn placements_are_checked_against_the_visible_gpus() {
        let p = |d: &[usize]| RankPlacement::on_devices(d).unwrap();
        assert!(p(&[0, 0, 0, 0]).check(1).is_ok());
        assert!(p(&[0, 1, 0, 1]).check(2).is_ok());
        match RankPlacement::one_per_gpu(3).unwrap().check(2) {
            Err(CudaError::TooFewGpus {
                requested: 3,
                available: 2,
            }) => {}
            other => panic!("expected TooFewGpus, got {other:?}"),
        }
        match p(&[0, 0, 1]).check(1) {
            Err(
                e @ CudaError::NoSuchGpu {
                    rank: 2,
                    device: 1,
                    available: 1,
                },
            ) => {
                let msg = e.to_string();
                assert!(
                    msg.contains("rank 2 is placed on GPU 1") && msg.contains("1 GPU"),
                    "{msg}"
                );
            }
            other => panic!("expected NoSuchGpu, got {other:?}"),
        }
        // No GPU at all: the first rank is named.
        assert!(matches!(
            p(&[1, 0]).check(0),
            Err(CudaError::NoSuchGpu {
                rank: 0,
                device: 1,
                available: 0
            })
        ));
    }

    #[test]
    fn the_nccl_refusal_names_the_pair_and_the_fix() {
        let e = SharedGpu {
            first: 0,
            second: 2,
            device: 0,
        }
        .nccl_error();
        let msg = e.to_string();
        assert!(
            msg.starts_with(
                "the NCCL transport needs one GPU per rank; this pool places ranks 0 and 2 on GPU 0"
            ),
            "{msg}"
        );
        assert!(
            msg.contains("Transport::Auto") && msg.contains("peer copies"),
            "{msg}"
        );
        assert!(matches!(
            e,
            CudaError::NcclNeedsOneGpuPerRank {
                first: 0,
                second: 2,
                device: 0
            }
        ));
    }
}
