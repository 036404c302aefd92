//! Copies of device state back to the host, for bit comparisons and round-trip checks.

use crate::backend::FsdpBackend;
use crate::FsdpError;

use lifecycle_cuda::{RankExecutor, RolloutBuffer};
use lifecycle_layout::{HostRollout, HostTensor};

use crate::state::{FsdpTrainState, RankDump, RankTrain};

impl<S: crate::buffers::FsdpBuffers> FsdpBackend<S> {
    /// Downloads the rollout weights of this process's ranks ([`RankExecutor::local_ranks`], all
    /// ranks in the single-process mode) to host memory (rollout order, same layout as the host
    /// backend's), for bit comparisons.
    pub fn download_rollout(&self, rollout: &RolloutBuffer) -> Result<HostRollout, FsdpError> {
        Ok(rollout.download(&*self.pool)?)
    }

    /// Downloads the training buffers of this process's ranks (from the device, or from the pinned
    /// copies while offloaded), flat and padded, for round-trip checks.
    pub fn download_state(&self, state: &FsdpTrainState) -> Result<Vec<RankDump>, FsdpError> {
        let mut items: Vec<&RankTrain> = state.ranks.iter().collect();
        Ok(self.pool.run_each(&mut items, &|ctx, rt| {
            ctx.sync_all()?;
            Ok(RankDump {
                master: rt.master.download(ctx, "downloading master")?,
                grads: match &rt.grads {
                    Some(g) => Some(
                        ctx.compute
                            .clone_dtoh(g)
                            .map_err(ctx.drv("downloading grads", 0))?,
                    ),
                    None => None,
                },
                m: rt.m.download(ctx, "downloading Adam m")?,
                v: rt.v.download(ctx, "downloading Adam v")?,
            })
        })?)
    }

    /// The full fp32 master tensor `name`, gathered from every rank's shard (single-process mode:
    /// a process that drives only some ranks gets an error).
    pub fn full_master(&self, state: &FsdpTrainState, name: &str) -> Result<Vec<f32>, FsdpError> {
        if self.pool.local_ranks().len() != self.pool.world() {
            return Err(FsdpError::Tensor {
                name: name.to_string(),
                problem: "gathering a full tensor needs every rank in this process; with one \
                          process per rank, download each rank's shard instead"
                    .into(),
            });
        }
        let i = state
            .layout
            .tensors()
            .iter()
            .position(|(n, _)| n == name)
            .ok_or_else(|| FsdpError::Tensor {
                name: name.to_string(),
                problem: "no such tensor in the training state".into(),
            })?;
        let dumps = self.download_state(state)?;
        let slot = &state.shards.slots[i];
        let mut out = Vec::new();
        for (rank, d) in dumps.iter().enumerate() {
            let held = state.shards.held_rows(i, rank);
            let at = slot.offset as usize;
            out.extend_from_slice(&d.master[at..at + held.len() * slot.cols]);
        }
        Ok(out)
    }

    /// Every full fp32 master tensor, in training order, gathered from one download of every
    /// rank's shards (single-process mode, like [`FsdpBackend::full_master`]): the host twin of
    /// the state, e.g. for `HostTrainState::from_tensors` and `reference_rollout`.
    pub fn full_masters(&self, state: &FsdpTrainState) -> Result<Vec<HostTensor>, FsdpError> {
        if self.pool.local_ranks().len() != self.pool.world() {
            return Err(FsdpError::Config(
                "gathering full tensors needs every rank in this process; with one process per \
                 rank, download each rank's shard instead"
                    .into(),
            ));
        }
        let dumps = self.download_state(state)?;
        Ok(state
            .layout
            .tensors()
            .iter()
            .zip(&state.shards.slots)
            .enumerate()
            .map(|(i, ((name, shape), slot))| {
                let mut data = Vec::with_capacity(shape.iter().product());
                for (rank, d) in dumps.iter().enumerate() {
                    let held = state.shards.held_rows(i, rank);
                    let at = slot.offset as usize;
                    data.extend_from_slice(&d.master[at..at + held.len() * slot.cols]);
                }
                HostTensor::f32(name.clone(), shape.clone(), data)
            })
            .collect())
    }
}
