//! What the same switch costs at 7.6B on GPUs, predicted by `lifecycle-plan` (its planners and
//! its prediction model, with the link rates measured on the project's 2×H200 machine,
//! [`LinkRates::default`]): the line every DAPO report prints, labelled as a prediction.

use lifecycle_decoder::ModelConfig;
use lifecycle_plan::{
    job_prediction, plan_fsdp, plan_megatron, LinkRates, Offload, PlanError, TrainLayout,
};

use crate::gpu_dapo::QWEN2_5_7B_CONFIG;

/// A predicted switch (the slowest rank's), in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SwitchPrediction {
    /// The training layout.
    pub train: TrainLayout,
    /// Rollout degree.
    pub tp: usize,
    /// Whether master weights and optimizer state are offloaded.
    pub offload: bool,
    /// Enter (transfer and offload overlapped).
    pub enter_s: f64,
    /// Exit (reload).
    pub exit_s: f64,
    /// Bytes one rank receives from its peers.
    pub recv_bytes: u64,
    /// Bytes one rank offloads at enter and reloads at exit.
    pub offload_bytes: u64,
}

impl SwitchPrediction {
    /// The report's line, labelled as a prediction.
    pub fn line(&self) -> String {
        let train = match self.train {
            TrainLayout::Fsdp { world } => format!("FSDP W = {world}"),
            TrainLayout::Megatron { tp, pp, dp, .. } => {
                format!("Megatron TP {tp} x PP {pp} x DP {dp}")
            }
        };
        let r = LinkRates::default();
        format!(
            "prediction (lifecycle-plan, rates measured on 2×H200: peer {:.0} GB/s, HBM {:.0} \
             GB/s, pinned {:.0} GB/s): the same switch at 7.6B (Qwen2.5-7B shapes, {train} -> \
             T = {}, offload {}) costs enter {:.1} ms + exit {:.1} ms = {:.1} ms per switch \
             (per rank: {:.2} GB from peers, {:.1} GB offloaded and reloaded)",
            r.nvlink_gbps,
            r.hbm_gbps,
            r.h2d_gbps,
            self.tp,
            if self.offload { "master + Adam" } else { "off" },
            self.enter_s * 1e3,
            self.exit_s * 1e3,
            (self.enter_s + self.exit_s) * 1e3,
            self.recv_bytes as f64 / 1e9,
            self.offload_bytes as f64 / 1e9,
        )
    }
}

/// The prediction for Qwen2.5-7B shapes, `train` → rollout degree `tp`, with or without the
/// offload, at `lifecycle-plan`'s default buckets (256 MiB, 2 in flight; Megatron's vocabulary
/// padded to a multiple of 128).
pub fn qwen7b_switch(
    train: TrainLayout,
    tp: usize,
    offload: bool,
) -> Result<SwitchPrediction, PlanError> {
    let config = ModelConfig::from_json_str(QWEN2_5_7B_CONFIG)
        .map_err(|e| PlanError::Arg(format!("the built-in Qwen2.5-7B config: {e}")))?;
    let what = if offload { Offload::ALL } else { Offload::NONE };
    let bucket = 256 << 20;
    let ranks = match train {
        TrainLayout::Fsdp { world } => plan_fsdp(&config, world, tp, bucket, 2, what)?,
        TrainLayout::Megatron {
            tp: mtp, pp, dp, ..
        } => plan_megatron(&config, mtp, pp, dp, tp, 128, bucket, what)?,
    };
    let p = job_prediction(&ranks, &LinkRates::default());
    Ok(SwitchPrediction {
        train,
        tp,
        offload,
        enter_s: p.enter_s,
        exit_s: p.exit_s,
        recv_bytes: ranks.iter().map(|r| r.recv_bytes).max().unwrap_or(0),
        offload_bytes: ranks.iter().map(|r| r.offload_bytes).max().unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_runs_have_a_prediction() {
        let p = qwen7b_switch(TrainLayout::Fsdp { world: 2 }, 2, true).unwrap();
        assert!(p.enter_s > 0.5 && p.exit_s > 0.5, "{p:?}"); // ~45 GB at 55 GB/s
        assert!(p
            .line()
            .starts_with("prediction (lifecycle-plan, rates measured on 2×H200"));
        let m = TrainLayout::Megatron {
            tp: 1,
            pp: 2,
            dp: 1,
            ep: 1,
            etp: 1,
        };
        let p = qwen7b_switch(m, 2, false).unwrap();
        assert!(p.enter_s > 0.0 && p.exit_s == 0.0, "{p:?}");
    }
}
