//! Downloads of the training state and the rollout weights, for checks against the CPU executor.

use crate::backend::MegatronGpuBackend;
use crate::buffers::MegatronBuffers;
use crate::build::resident;

use lifecycle_cuda::{RankExecutor, RolloutBuffer};
use lifecycle_layout::HostRollout;
use lifecycle_state::MemoryMeter;

use crate::error::MegatronGpuError;
use crate::state::{GpuRank, MegatronGpuState};
use lifecycle_state::megatron::{MegatronTrainState, RankTrain};

impl MegatronGpuBackend {
    /// The training state downloaded into the CPU backend's state (single-process mode): bf16
    /// params, grads, main params and Adam moments bit for bit; buffers offloaded on the GPU side
    /// are offloaded in the copy too. For round-trip checks and comparisons with the CPU backend.
    pub fn download_state(
        &self,
        state: &MegatronGpuState,
    ) -> Result<MegatronTrainState, MegatronGpuError> {
        self.check_state(state)?;
        if self.locals().len() != self.pool.world() {
            return Err(MegatronGpuError::NotAllLocal {
                operation: "downloading the whole training state",
                world: self.pool.world(),
                local: self.locals().len(),
            });
        }
        let mut items: Vec<&GpuRank> = state.ranks.iter().collect();
        let ranks = self.pool.run_each(&mut items, &|ctx, r| {
            ctx.sync_all()?;
            let params = r.params.download(ctx, "downloading bf16 parameters")?;
            let main = r.main.download(ctx, "downloading main params")?;
            let m = r.adam_m.download(ctx, "downloading Adam m")?;
            let v = r.adam_v.download(ctx, "downloading Adam v")?;
            let grads = match &r.grads {
                Some(g) => {
                    let mut g = ctx
                        .compute
                        .clone_dtoh(g)
                        .map_err(ctx.drv("downloading grads", 0))?;
                    g.truncate(r.params.len());
                    Some(g)
                }
                None => None,
            };
            let mut current = grads.as_ref().map_or(0, |g| g.len() * 4);
            for (on, bytes) in [
                (!r.params.is_offloaded(), r.params.bytes()),
                (!r.main.is_offloaded(), r.main.bytes()),
                (!r.adam_m.is_offloaded(), r.adam_m.bytes()),
                (!r.adam_v.is_offloaded(), r.adam_v.bytes()),
            ] {
                if on {
                    current += bytes;
                }
            }
            Ok(RankTrain {
                params: resident(!r.params.is_offloaded(), params),
                grads,
                shard: r.shard.clone(),
                main: resident(!r.main.is_offloaded(), main),
                adam_m: resident(!r.adam_m.is_offloaded(), m),
                adam_v: resident(!r.adam_v.is_offloaded(), v),
                meter: MemoryMeter {
                    current: current as u64,
                    peak: current as u64,
                },
            })
        })?;
        Ok(MegatronTrainState::from_ranks(
            (*state.layout).clone(),
            ranks,
            state.adam_steps,
        )?)
    }
}

impl<S: MegatronBuffers> MegatronGpuBackend<S> {
    /// Downloads the rollout weights of this process's ranks to host memory (rollout order,
    /// the CPU backend's layout), for bit comparisons.
    pub fn download_rollout(
        &self,
        rollout: &RolloutBuffer,
    ) -> Result<HostRollout, MegatronGpuError> {
        Ok(rollout.download(&*self.pool)?)
    }
}
