//! Offload by need: the least a switch must move out of device memory so that a rollout fits,
//! decided from what the rollout asks for and what the device has free, before anything moves.

use crate::metrics::HumanBytes;
use crate::policy::MemoryPolicy;

/// What a rollout needs on one device and what a switch could free there, in bytes (the
/// fullest rank's, when ranks differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RoomRequest {
    /// Free device memory now, with the training state resident.
    pub free: u64,
    /// The rollout weights, allocated at enter before anything is freed.
    pub rollout: u64,
    /// The transfer's staging at its peak (freed when the enter ends).
    pub staging: u64,
    /// What the engine allocates at wake: KV cache and workspace.
    pub engine: u64,
    /// Kept free besides (allocator rounding, library workspaces).
    pub margin: u64,
    /// Gradients: freed at every enter, whatever the policy.
    pub grads: u64,
    /// Optimizer state an offload may move.
    pub optimizer: u64,
    /// Master weights an offload may move.
    pub params: u64,
}

/// The decision of [`MemoryPolicy::by_need`]: the policy, and what it leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryDecision {
    /// The policy to switch with.
    pub policy: MemoryPolicy,
    /// Bytes each switch copies out (and back).
    pub offloaded: u64,
    /// Device memory left free while the rollout runs, beyond the margin.
    pub spare: u64,
    /// The request it was decided from.
    pub request: RoomRequest,
}

impl std::fmt::Display for MemoryDecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = &self.request;
        let what = match (self.policy.offload_params, self.policy.offload_optimizer) {
            (false, false) => "nothing offloaded".to_string(),
            (false, true) => format!("optimizer state offloaded ({})", HumanBytes(r.optimizer)),
            (true, true) => format!(
                "master weights and optimizer state offloaded ({})",
                HumanBytes(r.params + r.optimizer)
            ),
            (true, false) => format!("master weights offloaded ({})", HumanBytes(r.params)),
        };
        write!(
            f,
            "by need: rollout weights {} + engine {} + margin {} beside the training state \
             ({} free, gradients {} freed at enter): {what}, {} spare",
            HumanBytes(r.rollout),
            HumanBytes(r.engine),
            HumanBytes(r.margin),
            HumanBytes(r.free),
            HumanBytes(r.grads),
            HumanBytes(self.spare)
        )
    }
}

impl MemoryPolicy {
    /// The policy that offloads the least for `r` to fit: nothing when the rollout fits beside
    /// the training state (the rollout weights then stay resident and are refreshed in place),
    /// else the optimizer state (not needed again until the update's last step), else the
    /// master weights too. Whole classes of buffers move. An error says what does not fit even
    /// with everything offloaded, or when the rollout weights do not fit before anything moves
    /// (they are allocated first, so that a failure leaves the training state untouched).
    ///
    /// ```
    /// use lifecycle_core::{MemoryPolicy, RoomRequest};
    /// const GB: u64 = 1_000_000_000;
    /// // 7.6B on one 141 GB device: 91.4 GB of master + Adam, 15.2 GB of rollout weights
    /// let r = RoomRequest {
    ///     free: 48 * GB, rollout: 15 * GB, engine: GB / 10, margin: 2 * GB,
    ///     optimizer: 61 * GB, params: 30 * GB, ..RoomRequest::default()
    /// };
    /// let d = MemoryPolicy::by_need(&r)?;
    /// assert!(!d.policy.offload_params && !d.policy.offload_optimizer && d.offloaded == 0);
    /// // a KV room of 40 GB needs the optimizer state out
    /// let d = MemoryPolicy::by_need(&RoomRequest { engine: 40 * GB, ..r })?;
    /// assert!(d.policy.offload_optimizer && !d.policy.offload_params);
    /// // 130 GB cannot fit even with 91 GB offloaded (33 + 91 GB free after the enter)
    /// assert!(MemoryPolicy::by_need(&RoomRequest { engine: 130 * GB, ..r }).is_err());
    /// # Ok::<(), String>(())
    /// ```
    pub fn by_need(r: &RoomRequest) -> Result<MemoryDecision, String> {
        let at_enter = r.rollout + r.staging + r.margin;
        if at_enter > r.free {
            return Err(format!(
                "the rollout weights ({}) and the transfer's staging ({}) need {} with a margin \
                 of {} before anything moves, {} is free: free device memory, or roll out at a \
                 larger T",
                HumanBytes(r.rollout),
                HumanBytes(r.staging),
                HumanBytes(at_enter),
                HumanBytes(r.margin),
                HumanBytes(r.free)
            ));
        }
        // After the enter: the rollout weights held, the gradients freed.
        let room = r.free - r.rollout + r.grads;
        let need = r.engine + r.margin;
        let choices = [
            (false, false, 0),
            (false, true, r.optimizer),
            (true, true, r.optimizer + r.params),
        ];
        for (params, optimizer, moved) in choices {
            if need <= room + moved {
                return Ok(MemoryDecision {
                    policy: MemoryPolicy {
                        offload_params: params,
                        offload_optimizer: optimizer,
                        keep_rollout_resident: !params && !optimizer,
                    },
                    offloaded: moved,
                    spare: room + moved - need,
                    request: *r,
                });
            }
        }
        Err(format!(
            "the engine needs {} (+ {} margin) while the rollout runs; with the master weights \
             and optimizer state offloaded {} would be free: ask for fewer KV tokens or a larger T",
            HumanBytes(r.engine),
            HumanBytes(r.margin),
            HumanBytes(room + r.optimizer + r.params)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1_000_000_000;

    fn request() -> RoomRequest {
        RoomRequest {
            free: 20 * GB,
            rollout: 10 * GB,
            staging: GB,
            engine: 5 * GB,
            margin: GB,
            grads: 0,
            optimizer: 8 * GB,
            params: 4 * GB,
        }
    }

    #[test]
    fn the_least_is_offloaded_and_the_boundaries_hold() {
        // room after enter: 10 GB; need 6 GB
        let d = MemoryPolicy::by_need(&request()).unwrap();
        assert_eq!((d.offloaded, d.spare), (0, 4 * GB));
        assert!(d.policy.keep_rollout_resident);
        assert!(d.policy.validate().is_ok());
        // need exactly the room: still nothing
        let r = RoomRequest {
            engine: 9 * GB,
            ..request()
        };
        assert_eq!(MemoryPolicy::by_need(&r).unwrap().offloaded, 0);
        // one byte more: the optimizer state goes
        let r = RoomRequest {
            engine: 9 * GB + 1,
            ..request()
        };
        let d = MemoryPolicy::by_need(&r).unwrap();
        assert!(d.policy.offload_optimizer && !d.policy.offload_params);
        assert!(!d.policy.keep_rollout_resident && d.policy.validate().is_ok());
        // beyond optimizer: both
        let r = RoomRequest {
            engine: 17 * GB + 1,
            ..request()
        };
        let d = MemoryPolicy::by_need(&r).unwrap();
        assert!(d.policy.offload_optimizer && d.policy.offload_params);
        assert_eq!(d.offloaded, 12 * GB);
        // gradients freed at enter count as room
        let r = RoomRequest {
            engine: 11 * GB,
            grads: 3 * GB,
            ..request()
        };
        assert_eq!(MemoryPolicy::by_need(&r).unwrap().offloaded, 0);
    }

    #[test]
    fn a_lifecycle_keeps_its_decision_in_metrics_and_trace() {
        use crate::testing::CopyBackend;
        use crate::Lifecycle;
        let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0, 2.0]);
        lc.enable_trace();
        let optimizer_out = RoomRequest {
            engine: 9 * GB + 1,
            ..request()
        };
        let d = MemoryPolicy::by_need(&optimizer_out).unwrap();
        lc.set_memory_decision(d).unwrap();
        assert_eq!(lc.config().memory, d.policy);
        assert_eq!(lc.metrics().memory, Some(d));
        assert!(lc
            .trace()
            .spans()
            .iter()
            .any(|s| s.name.contains("optimizer state offloaded")));
        lc.reset_metrics();
        assert_eq!(lc.metrics().memory, Some(d), "a reset keeps the decision");
        // not while rollout weights are resident
        lc.rollout().unwrap().finish().unwrap();
        let other = MemoryPolicy::by_need(&request()).unwrap();
        assert!(lc.set_memory_decision(other).is_err());
        assert_eq!(lc.config().memory, d.policy);
    }

    #[test]
    fn what_cannot_fit_is_said() {
        let r = RoomRequest {
            engine: 30 * GB,
            ..request()
        };
        let e = MemoryPolicy::by_need(&r).unwrap_err();
        assert!(e.contains("fewer KV tokens"), "{e}");
        let r = RoomRequest {
            rollout: 19 * GB,
            ..request()
        };
        let e = MemoryPolicy::by_need(&r).unwrap_err();
        assert!(e.contains("before anything moves"), "{e}");
        let d = MemoryPolicy::by_need(&request()).unwrap();
        assert!(d.to_string().contains("nothing offloaded"), "{d}");
    }
}
