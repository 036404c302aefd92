//! [`Switch`]: the one switch a front (the Python package) drives, over host arrays (the CPU
//! reference backend) or lent GPU shards, or closed. Every call is decided here, once, so a
//! front converts its arguments and calls through without asking which kind it holds.

use std::sync::Arc;

use lifecycle_cuda::ThreadRankPool;

use crate::error::BridgeError;
use crate::gpu::{GpuRankParts, GpuSwitch};
use crate::host::{HostSwitch, SwitchSettings};
use crate::model::ModelBinding;
use crate::shards::Shard;
use crate::switch::{Entered, SwitchStats};
use crate::views::{Leases, TensorView};

/// A switch over host arrays or lent GPU shards, or closed ([`Switch::close`]).
///
/// ```
/// use lifecycle_bridge::{Switch, SwitchSettings, ModelBinding};
/// # fn demo(binding: ModelBinding) -> Result<(), lifecycle_bridge::BridgeError> {
/// let mut s = Switch::build(binding, SwitchSettings::new(1, 1), "cpu", || unreachable!())?;
/// assert_eq!(s.local_ranks()?, vec![0]);
/// drop(s.close()?);
/// assert!(s.is_closed() && s.stats().is_err());
/// # Ok(()) }
/// ```
pub enum Switch {
    /// Over host arrays, on the CPU reference backend.
    Host(Box<HostSwitch>),
    /// Over lent GPU shards.
    Gpu(Box<GpuSwitch>),
    /// Closed: its memory is freed, every call but `close` refused.
    Closed,
}

/// The error of any call on a closed switch.
pub fn closed() -> BridgeError {
    BridgeError::Config(
        "this switch is closed (close() freed its memory): build a new one to roll out again"
            .into(),
    )
}

impl Switch {
    /// A switch of `binding` on `device`: `"cpu"` (the reference backend) or `"cuda"` (on the
    /// ranks `pool` makes, called only for it).
    pub fn build(
        binding: ModelBinding,
        settings: SwitchSettings,
        device: &str,
        pool: impl FnOnce() -> Result<ThreadRankPool, BridgeError>,
    ) -> Result<Self, BridgeError> {
        match device {
            "cpu" => Ok(Switch::Host(Box::new(HostSwitch::new(binding, settings)?))),
            "cuda" => Ok(Switch::Gpu(Box::new(GpuSwitch::new(
                binding,
                settings,
                Arc::new(pool()?),
            )?))),
            other => Err(BridgeError::Config(format!(
                "device `{other}`: expected \"cpu\" (the reference backend) or \"cuda\""
            ))),
        }
    }

    /// The handed-out views' leases (empty for a closed switch).
    pub fn leases(&self) -> Arc<Leases> {
        match self {
            Switch::Host(s) => s.leases().clone(),
            Switch::Gpu(s) => s.leases().clone(),
            Switch::Closed => Arc::new(Leases::default()),
        }
    }

    /// Checks shards as [`Switch::enter`] would, reading nothing.
    pub fn check_shards(&self, shards: &[Vec<Shard>]) -> Result<(), BridgeError> {
        match self {
            Switch::Host(s) => s.check_shards(shards),
            Switch::Gpu(s) => s.check_shards(shards),
            Switch::Closed => Err(closed()),
        }
    }

    /// Enters rollout mode from what is lent per rank ([`HostSwitch::enter`] reads only the
    /// shards; [`GpuSwitch::enter`] also the offload buffers and the stream).
    ///
    /// # Safety
    /// As the kind's `enter` says: host shards point to that many fp32 values readable for the
    /// call; GPU shards are live fp32 device memory kept alive as [`GpuSwitch::enter`] states.
    pub unsafe fn enter(
        &mut self,
        lent: Vec<GpuRankParts>,
        changed: bool,
    ) -> Result<Entered, BridgeError> {
        match self {
            Switch::Host(s) => {
                let shards: Vec<Vec<Shard>> = lent.into_iter().map(|p| p.shards).collect();
                // SAFETY: forwarded to the caller.
                unsafe { s.enter(&shards, changed) }
            }
            // SAFETY: forwarded to the caller.
            Switch::Gpu(s) => unsafe { s.enter(lent, changed) },
            Switch::Closed => Err(closed()),
        }
    }

    /// A rollout call on current resident weights, or `None` when `enter` is needed.
    pub fn reuse_current(&mut self) -> Result<Option<Entered>, BridgeError> {
        match self {
            Switch::Host(s) => s.reuse_current(),
            Switch::Gpu(s) => s.reuse_current(),
            Switch::Closed => Err(closed()),
        }
    }

    /// The rollout tensors of local rank `local`.
    pub fn views(&mut self, local: usize) -> Result<Vec<TensorView>, BridgeError> {
        match self {
            Switch::Host(s) => s.views(local),
            Switch::Gpu(s) => s.views(local),
            Switch::Closed => Err(closed()),
        }
    }

    /// Leaves rollout mode (refused while handed-out views are referenced).
    pub fn exit(&mut self) -> Result<(), BridgeError> {
        match self {
            Switch::Host(s) => s.exit(),
            Switch::Gpu(s) => s.exit(),
            Switch::Closed => Err(closed()),
        }
    }

    /// Leaves rollout mode and closes the switch (refused while handed-out views are
    /// referenced; a closed switch stays closed): the switch that was, for the caller to drop
    /// where it may (a GPU switch holds the front's callables).
    pub fn close(&mut self) -> Result<Switch, BridgeError> {
        match self {
            Switch::Host(s) => s.exit_for("close")?,
            Switch::Gpu(s) => s.exit_for("close")?,
            Switch::Closed => return Ok(Switch::Closed),
        }
        Ok(std::mem::replace(self, Switch::Closed))
    }

    /// Whether [`Switch::close`] ran.
    pub fn is_closed(&self) -> bool {
        matches!(self, Switch::Closed)
    }

    /// Counts and times of the switches so far.
    pub fn stats(&self) -> Result<SwitchStats, BridgeError> {
        match self {
            Switch::Host(s) => Ok(s.stats()),
            Switch::Gpu(s) => Ok(s.stats()),
            Switch::Closed => Err(closed()),
        }
    }

    /// The ranks whose rollout tensors this process reads: the rollout ranks `0..T` of a host
    /// switch, the global ranks this process drives on the GPU.
    pub fn local_ranks(&self) -> Result<Vec<usize>, BridgeError> {
        match self {
            Switch::Host(s) => Ok(s.rollout_ranks().collect()),
            Switch::Gpu(s) => s.local_ranks(),
            Switch::Closed => Err(closed()),
        }
    }

    /// The GPU switch, for what only it does (the engine), or why there is none.
    pub fn gpu(&mut self) -> Result<&mut GpuSwitch, BridgeError> {
        match self {
            Switch::Gpu(s) => Ok(s),
            Switch::Host(_) => Err(BridgeError::Config(
                "the project's GPU engine needs a switch on device \"cuda\"; this one is on \
                 \"cpu\" (the reference backend): build it with from_fsdp2 on CUDA parameters"
                    .into(),
            )),
            Switch::Closed => Err(closed()),
        }
    }
}
