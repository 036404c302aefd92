//! A front's settings as it passes them (strings and numbers), parsed and checked here, each
//! error naming the argument: the switch's ([`switch_settings`]), the engine's
//! ([`engine_settings`]), an offload buffer's class ([`buffer_class`]), and the GPU ranks of
//! this process ([`gpu_pool`]).

use std::time::Duration;

use lifecycle_core::{MemoryPolicy, Switching};
use lifecycle_cuda::driver::BufferClass;
use lifecycle_cuda::ThreadRankPool;
use lifecycle_decoder_gpu::EngineSettings;
use lifecycle_layout::fp8::{Fp8Compute, Fp8Keep, RolloutDtype};
use lifecycle_layout::ExpertPlacement;
use lifecycle_layout::KvDtype;

use crate::error::BridgeError;
use crate::host::SwitchSettings;
use crate::model::ModelBinding;

/// A switch's settings as a front names them.
#[derive(Debug, Clone, Copy)]
pub struct SettingsText<'a> {
    /// The trainer's world size W.
    pub world: usize,
    /// The rollout's tensor-parallel degree T.
    pub tp: usize,
    /// `"bf16"` or `"fp8"`.
    pub dtype: &'a str,
    /// `"tp"` or `"ep"`.
    pub experts: &'a str,
    /// `"none"`, `"params"`, `"optimizer"` or `"all"`.
    pub offload: &'a str,
    /// `"lazy"` or `"eager"` (the front's: the lifecycle itself stays lazy).
    pub switching: &'a str,
    /// `"none"`, or a comma-separated list of `attention` and `layer:N`.
    pub fp8_keep: &'a str,
}

/// The switch settings `text` names for `binding`'s model, each checked with its argument
/// named.
///
/// ```
/// use lifecycle_bridge::settings::{switch_settings, SettingsText};
/// use lifecycle_bridge::ModelBinding;
/// # fn demo(binding: &ModelBinding) {
/// let text = SettingsText { world: 2, tp: 2, dtype: "fp16", experts: "tp", offload: "none",
///     switching: "lazy", fp8_keep: "none" };
/// let e = switch_settings(&text, binding).unwrap_err().to_string();
/// assert!(e.contains("dtype"), "{e}");
/// # }
/// ```
pub fn switch_settings(
    text: &SettingsText<'_>,
    binding: &ModelBinding,
) -> Result<SwitchSettings, BridgeError> {
    let mut settings = SwitchSettings::new(text.world, text.tp);
    settings.options.dtype = dtype(text.dtype)?;
    settings.options.fp8_keep = keep(text.fp8_keep, settings.options.dtype, binding)?;
    settings.experts = experts(text.experts)?;
    settings.lifecycle.memory = memory(text.offload)?;
    // eager is the front's (it leaves after every session); the lifecycle stays lazy so a
    // session's weights live until the session ends
    parse::<Switching>("switching", text.switching)?;
    settings.lifecycle.switching = Switching::Lazy;
    Ok(settings)
}

/// The engine's settings: KV room for `max_sequences` of `max_tokens`, fp8 products as
/// `fp8_compute` says (`w8a8` or `weight-only`), K and V kept in `kv_dtype` (`bf16`, `f32` or
/// `fp8`); checked with the argument named.
pub fn engine_settings(
    max_sequences: usize,
    max_tokens: usize,
    fp8_compute: &str,
    kv_dtype: &str,
) -> Result<EngineSettings, BridgeError> {
    let compute: Fp8Compute = parse("fp8_compute", fp8_compute)?;
    let kv: KvDtype = parse("kv_dtype", kv_dtype)?;
    let settings = EngineSettings::new(max_sequences, max_tokens)
        .with_fp8_compute(compute)
        .with_kv_dtype(kv);
    settings
        .check()
        .map_err(|e| BridgeError::Config(e.to_string()))?;
    Ok(settings)
}

fn parse<T: std::str::FromStr<Err = String>>(what: &str, value: &str) -> Result<T, BridgeError> {
    value
        .parse()
        .map_err(|e: String| BridgeError::Config(format!("{what}: {e}")))
}

/// The `fp8_keep` setting (`"none"`, or a comma-separated list of `attention` and `layer:N`)
/// for `binding`'s model, which only an fp8 rollout reads.
fn keep(value: &str, dtype: RolloutDtype, binding: &ModelBinding) -> Result<Fp8Keep, BridgeError> {
    // the layout's messages say "fp8 keep …": Python's argument is `fp8_keep`
    let named = |e: String| {
        BridgeError::Config(match e.strip_prefix("fp8 keep") {
            Some(rest) => format!("fp8_keep{rest}"),
            None => format!("fp8_keep: {e}"),
        })
    };
    let keep: Fp8Keep = value.parse().map_err(named)?;
    keep.check_layers(binding.names().iter().map(|(n, _)| n.as_str()))
        .map_err(|e| named(e.to_string()))?;
    if keep != Fp8Keep::default() && dtype != RolloutDtype::Fp8 {
        return Err(BridgeError::Config(format!(
            "fp8_keep `{value}` keeps matrices of an fp8 rollout bf16, and this switch's dtype \
             is {dtype}: pass dtype=\"fp8\" or leave fp8_keep out"
        )));
    }
    Ok(keep)
}

pub(crate) fn dtype(value: &str) -> Result<RolloutDtype, BridgeError> {
    match value {
        "bf16" | "bfloat16" => Ok(RolloutDtype::Bf16),
        "fp8" => Ok(RolloutDtype::Fp8),
        other => Err(BridgeError::Config(format!(
            "dtype: `{other}` is not a rollout dtype: expected \"bf16\" or \"fp8\""
        ))),
    }
}

pub(crate) fn experts(value: &str) -> Result<ExpertPlacement, BridgeError> {
    match value {
        "tp" => Ok(ExpertPlacement::TensorParallel),
        "ep" => Ok(ExpertPlacement::Partitioned),
        other => Err(BridgeError::Config(format!(
            "experts: `{other}`: expected \"tp\" (every expert split by T) or \"ep\" (experts \
             partitioned over the T ranks)"
        ))),
    }
}

fn memory(offload: &str) -> Result<MemoryPolicy, BridgeError> {
    let (params, optimizer) = match offload {
        "none" => (false, false),
        "params" => (true, false),
        "optimizer" => (false, true),
        "all" => (true, true),
        other => {
            return Err(BridgeError::Config(format!(
                "offload: `{other}`: expected \"none\", \"params\", \"optimizer\" or \"all\""
            )))
        }
    };
    Ok(MemoryPolicy {
        offload_params: params,
        offload_optimizer: optimizer,
        // nothing offloaded: the rollout weights stay and are refreshed in place
        keep_rollout_resident: !params && !optimizer,
    })
}

/// The class of an offload buffer named `name`: `"params"` or `"optimizer"`.
pub fn buffer_class(name: &str, value: &str) -> Result<BufferClass, BridgeError> {
    match value {
        "params" => Ok(BufferClass::Params),
        "optimizer" => Ok(BufferClass::Optimizer),
        other => Err(BridgeError::tensor(
            name,
            format!("offload class `{other}`: expected \"params\" or \"optimizer\""),
        )),
    }
}

/// The GPU ranks of this process: W = 1 on GPU `gpu` (the caller's current device), or, for
/// W > 1, this process's rank of a job launched like PyTorch (torchrun's variables; rank 0
/// shares the NCCL id through torchrun's store).
pub fn gpu_pool(world: usize, gpu: usize) -> Result<ThreadRankPool, BridgeError> {
    if world == 1 {
        return ThreadRankPool::on_devices(&[gpu]).map_err(BridgeError::backend);
    }
    let env = lifecycle_dist::RankEnv::from_env()
        .map_err(BridgeError::backend)?
        .ok_or_else(|| {
            BridgeError::Config(format!(
                "a CUDA switch over W = {world} ranks runs one process per GPU, launched like \
                 PyTorch (torchrun): RANK / WORLD_SIZE are not set"
            ))
        })?;
    if env.world_size != world {
        return Err(BridgeError::Config(format!(
            "the parameters are sharded over {world} ranks, the launcher's WORLD_SIZE is {}",
            env.world_size
        )));
    }
    ThreadRankPool::for_process(&env, Duration::from_secs(120)).map_err(BridgeError::backend)
}
