//! A front's settings as it passes them (strings and numbers), parsed and checked here, each
//! error naming the argument: the switch's ([`switch_settings`]), the engine's
//! ([`engine_settings`]), a call's requests ([`requests`]), a streamed fill's ([`group_stream`]),
//! an offload buffer's class
//! ([`buffer_class`]), and the GPU ranks of this process ([`gpu_pool`]).

use std::time::Duration;

use lifecycle_core::{MemoryPolicy, Switching};
use lifecycle_cuda::driver::BufferClass;
use lifecycle_cuda::ThreadRankPool;
use lifecycle_decoder::{GroupStream, Leftovers, Request, SamplingParams};
use lifecycle_decoder_gpu::{EngineSettings, LoraMode};
use lifecycle_layout::fp8::{Fp8Compute, Fp8Keep, RolloutDtype};
use lifecycle_layout::ExpertPlacement;
use lifecycle_layout::KvDtype;

use lifecycle_core::LifecycleConfig;
use lifecycle_layout::lora::LoraConfig;
use lifecycle_layout::settings::SwitchOptions;

use crate::error::BridgeError;

/// What a switch is asked to build (both backends).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwitchSettings {
    /// FSDP world size W of the trainer.
    pub world: usize,
    /// Rollout tensor-parallel degree T.
    pub tp: usize,
    /// What the backend switches to and how (dtype, fp8 exemptions; the options every backend
    /// holds).
    pub options: SwitchOptions,
    /// Where the experts of a mixture-of-experts model go.
    pub experts: ExpertPlacement,
    /// What the switch moves out of device memory during rollout, and when it leaves rollout.
    pub lifecycle: LifecycleConfig,
}

impl SwitchSettings {
    /// W ranks → T, bf16, experts split by TP, lazy, nothing offloaded (the rollout weights
    /// refreshed in place when the trainer changed its shards).
    pub fn new(world: usize, tp: usize) -> Self {
        SwitchSettings {
            world,
            tp,
            options: SwitchOptions::default(),
            experts: ExpertPlacement::TensorParallel,
            lifecycle: LifecycleConfig {
                switching: Switching::Lazy,
                memory: MemoryPolicy {
                    keep_rollout_resident: true,
                    ..MemoryPolicy::resident()
                },
            },
        }
    }
}

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

/// The switch settings `text` names for a model of the tensors `names` with the LoRA
/// adapters of `lora` (a [`ModelBinding`](crate::ModelBinding)'s), each checked with its
/// argument named.
///
/// ```
/// use lifecycle_bridge::settings::{switch_settings, SettingsText};
/// use lifecycle_bridge::ModelBinding;
/// # fn demo(binding: &ModelBinding) {
/// let text = SettingsText { world: 2, tp: 2, dtype: "fp16", experts: "tp", offload: "none",
///     switching: "lazy", fp8_keep: "none" };
/// let e = switch_settings(&text, binding.names(), binding.lora()).unwrap_err().to_string();
/// assert!(e.contains("dtype"), "{e}");
/// # }
/// ```
pub fn switch_settings(
    text: &SettingsText<'_>,
    names: &[(String, Vec<usize>)],
    lora: Option<&LoraConfig>,
) -> Result<SwitchSettings, BridgeError> {
    let mut settings = SwitchSettings::new(text.world, text.tp);
    settings.options.dtype = dtype(text.dtype)?;
    settings.options.fp8_keep = keep(text.fp8_keep, settings.options.dtype, names)?;
    settings.experts = experts(text.experts)?;
    settings.lifecycle.memory = memory(text.offload)?;
    // eager is the front's (it leaves after every session); the lifecycle stays lazy so a
    // session's weights live until the session ends
    parse::<Switching>("switching", text.switching)?;
    settings.lifecycle.switching = Switching::Lazy;
    // a LoRA model's base is frozen: cast once, the adapters (and the whole tensors trained
    // beside them) refreshed alone
    if let Some(lora) = lora {
        settings.options.frozen_base = true;
        settings.options.trained = lora.trained.clone();
    }
    Ok(settings)
}

/// PEFT's `LoraConfig` as a front passes it: rank `r`, `lora_alpha`, `target_modules` (the
/// module names: `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`),
/// `use_rslora`, and `trained`: the whole tensors trained beside the adapters (the model's
/// names of PEFT's `modules_to_save` weights and trainable biases; checked against the model
/// when it is bound, [`ModelBinding::with_lora`](crate::ModelBinding::with_lora)); each
/// refused naming the field.
///
/// ```
/// use lifecycle_bridge::settings::lora;
/// let config = lora(8, 16.0, &["q_proj".into(), "down_proj".into()], false, &["lm_head.weight".into()])?;
/// assert_eq!(config.scaling(), 2.0);
/// assert!(config.trained.moves("lm_head.weight"));
/// let err = lora(8, 16.0, &["lm_head".into()], false, &[]).unwrap_err();
/// assert!(err.to_string().contains("target_modules"), "{err}");
/// let err = lora(8, 16.0, &["q_proj".into()], false, &["q.weight".into(), "q.weight".into()]);
/// assert!(err.unwrap_err().to_string().contains("`q.weight` is named twice"));
/// # Ok::<(), lifecycle_bridge::BridgeError>(())
/// ```
pub fn lora(
    r: usize,
    alpha: f64,
    targets: &[String],
    rslora: bool,
    trained: &[String],
) -> Result<lifecycle_layout::lora::LoraConfig, BridgeError> {
    use lifecycle_layout::lora::{LoraConfig, LoraTarget, Trained};
    if r == 0 {
        return Err(BridgeError::Config(
            "lora: r must be at least 1, found 0".into(),
        ));
    }
    if !(alpha.is_finite() && alpha > 0.0) {
        return Err(BridgeError::Config(format!(
            "lora: lora_alpha must be a positive finite number, found {alpha}"
        )));
    }
    let targets = targets
        .iter()
        .map(|t| {
            LoraTarget::from_module(t).ok_or_else(|| {
                BridgeError::Config(format!(
                    "lora: target_modules: `{t}` is not a linear layer the switch adapts (q_proj, \
                     k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"
                ))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    for (i, name) in trained.iter().enumerate() {
        if trained[..i].contains(name) {
            return Err(BridgeError::Config(format!(
                "lora: trained tensors: `{name}` is named twice"
            )));
        }
    }
    Ok(LoraConfig::new(r, alpha, targets)
        .with_rslora(rslora)
        .with_trained(Trained::new(trained.iter().cloned())))
}

/// The engine's settings: up to `max_sequences` sequences of up to `max_tokens` at once in a KV
/// cache of `kv_tokens` positions (`None`: room for all of them at their longest), fp8 products
/// as `fp8_compute` says (`w8a8` or `weight-only`), K and V kept in `kv_dtype` (`bf16`, `f32` or
/// `fp8`), LoRA adapters applied as `lora_mode` says (`unmerged` or `merged`); checked with the
/// argument named.
pub fn engine_settings(
    (max_sequences, max_tokens): (usize, usize),
    kv_tokens: Option<usize>,
    (fp8_compute, kv_dtype): (&str, &str),
    lora_mode: &str,
) -> Result<EngineSettings, BridgeError> {
    let compute: Fp8Compute = parse("fp8_compute", fp8_compute)?;
    let kv: KvDtype = parse("kv_dtype", kv_dtype)?;
    let lora: LoraMode = parse("lora_mode", lora_mode)?;
    let mut settings = EngineSettings::new(max_sequences, max_tokens)
        .with_fp8_compute(compute)
        .with_kv_dtype(kv)
        .with_lora_mode(lora);
    if let Some(tokens) = kv_tokens {
        settings = settings.with_kv_tokens(tokens);
    }
    settings
        .check()
        .map_err(|e| BridgeError::Config(e.to_string()))?;
    Ok(settings)
}

/// How a front's requests sample (every request of a call, or of a stream, alike).
#[derive(Debug, Clone)]
pub struct SamplingText {
    /// Sampling temperature (0: greedy).
    pub temperature: f32,
    /// Nucleus mass kept (1: all).
    pub top_p: f32,
    /// Most likely tokens kept (`None`: all).
    pub top_k: Option<u32>,
    /// Tokens that end a sample.
    pub stop_tokens: Vec<u32>,
}

impl SamplingText {
    /// These settings for a request of up to `max_new_tokens` tokens seeded `seed` (checked
    /// when the request is submitted: `Request::check`).
    pub fn params(&self, max_new_tokens: usize, seed: u64) -> SamplingParams {
        let mut p = SamplingParams::new(max_new_tokens)
            .with_temperature(self.temperature)
            .with_top_p(self.top_p)
            .with_stop_tokens(self.stop_tokens.clone())
            .with_seed(seed);
        p.top_k = self.top_k;
        p
    }
}

/// One request per prompt, each with its `max_new_tokens` and `seeds` entry and `sampling`:
/// the lists one entry per prompt, or an error naming them.
pub fn requests(
    prompts: Vec<Vec<u32>>,
    max_new_tokens: Vec<usize>,
    seeds: Vec<u64>,
    sampling: &SamplingText,
) -> Result<Vec<Request>, BridgeError> {
    if max_new_tokens.len() != prompts.len() || seeds.len() != prompts.len() {
        return Err(BridgeError::Config(format!(
            "{} prompts, {} max_new_tokens and {} seeds: one of each per prompt",
            prompts.len(),
            max_new_tokens.len(),
            seeds.len()
        )));
    }
    Ok(prompts
        .into_iter()
        .zip(max_new_tokens.into_iter().zip(seeds))
        .map(|(prompt, (n, seed))| Request::new(prompt, sampling.params(n, seed)))
        .collect())
}

/// A streamed fill's settings (DAPO's dynamic sampling, [`GroupStream`]) as a front names them.
#[derive(Debug, Clone)]
pub struct StreamText<'a> {
    /// Samples of each prompt group.
    pub group_size: usize,
    /// Tokens a sample may add.
    pub max_new_tokens: usize,
    /// How its requests sample.
    pub sampling: SamplingText,
    /// The stream's seed (each sample's is derived from it: [`GroupSampling::requests`]).
    pub seed: u64,
    /// `"abort"` or `"partial"`: what becomes of requests in flight when a fill ends.
    pub leftovers: &'a str,
    /// Partial rollouts' staleness bound in weight versions (with `"partial"` only; 1 when not
    /// given).
    pub max_staleness: Option<u64>,
    /// New groups a fill submits at most.
    pub max_groups: Option<usize>,
}

/// How a stream's requests are sampled: its groups' size and the settings they share.
#[derive(Debug, Clone)]
pub struct GroupSampling {
    group_size: usize,
    params: SamplingParams,
}

impl GroupSampling {
    /// Group `g`'s requests for `prompt`: its samples `j` seeded
    /// `SamplingParams::seed_of(seed, g · group_size + j)`, so a sample's draws depend on its
    /// place in the stream alone.
    pub fn requests(&self, g: u64, prompt: &[u32]) -> Vec<Request> {
        let n = self.group_size as u64;
        (0..n)
            .map(|j| {
                let seed = SamplingParams::seed_of(self.params.seed, g * n + j);
                Request::new(prompt.to_vec(), self.params.clone().with_seed(seed))
            })
            .collect()
    }
}

/// The stream and its requests' sampling of `text`, each setting checked with its argument
/// named (`leftovers`, `max_staleness` without partial rollouts, `group_size` 0).
///
/// ```
/// use lifecycle_bridge::settings::{group_stream, SamplingText, StreamText};
/// let sampling = SamplingText { temperature: 1.0, top_p: 1.0, top_k: None, stop_tokens: vec![] };
/// let text = StreamText { group_size: 4, max_new_tokens: 8, sampling, seed: 7,
///     leftovers: "abort", max_staleness: Some(2), max_groups: None };
/// let e = group_stream(&text).unwrap_err().to_string();
/// assert!(e.contains("max_staleness") && e.contains("partial"), "{e}");
/// let (_, sampling) = group_stream(&StreamText { max_staleness: None, ..text })?;
/// assert_eq!(sampling.requests(3, &[1, 2]).len(), 4);
/// # Ok::<(), lifecycle_bridge::BridgeError>(())
/// ```
pub fn group_stream(text: &StreamText<'_>) -> Result<(GroupStream, GroupSampling), BridgeError> {
    let config = BridgeError::Config;
    let leftovers = match (text.leftovers, text.max_staleness) {
        ("abort", None) => Leftovers::Abort,
        ("abort", Some(_)) => {
            return Err(config(
                "max_staleness bounds partial rollouts: pass leftovers=\"partial\" with it \
                 (aborted requests are never continued)"
                    .into(),
            ))
        }
        ("partial", n) => Leftovers::Partial {
            max_staleness: n.unwrap_or(1),
        },
        (other, _) => {
            return Err(config(format!(
                "leftovers: expected \"abort\" or \"partial\", found {other:?}"
            )))
        }
    };
    if text.group_size == 0 {
        return Err(config(
            "group_size: expected a positive integer, found 0".into(),
        ));
    }
    let params = text.sampling.params(text.max_new_tokens, text.seed);
    let mut stream = GroupStream::new(text.group_size, leftovers);
    if let Some(n) = text.max_groups {
        stream = stream.with_max_groups(n);
    }
    Ok((
        stream,
        GroupSampling {
            group_size: text.group_size,
            params,
        },
    ))
}

fn parse<T: std::str::FromStr<Err = String>>(what: &str, value: &str) -> Result<T, BridgeError> {
    value
        .parse()
        .map_err(|e: String| BridgeError::Config(format!("{what}: {e}")))
}

/// The `fp8_keep` setting (`"none"`, or a comma-separated list of `attention` and `layer:N`)
/// for a model of the tensors `names`, which only an fp8 rollout reads.
fn keep(
    value: &str,
    dtype: RolloutDtype,
    names: &[(String, Vec<usize>)],
) -> Result<Fp8Keep, BridgeError> {
    // the layout's messages say "fp8 keep …": Python's argument is `fp8_keep`
    let named = |e: String| {
        BridgeError::Config(match e.strip_prefix("fp8 keep") {
            Some(rest) => format!("fp8_keep{rest}"),
            None => format!("fp8_keep: {e}"),
        })
    };
    let keep: Fp8Keep = value.parse().map_err(named)?;
    keep.check_layers(names.iter().map(|(n, _)| n.as_str()))
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

/// Where a CUDA switch's ranks run, as a front names it (`ranks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankHome {
    /// `"process"`: W = 1 on the GPU given, or, for W > 1, this process's rank of a job
    /// launched like PyTorch (one GPU per process, NCCL between them).
    Process,
    /// `"shared-gpu"`: all W ranks in this process on the GPU given, no NCCL: a job whose ranks
    /// share one GPU (each process switches every rank, reading the others' tensors through
    /// CUDA IPC). A test configuration: it costs W times the rollout memory per process.
    SharedGpu,
}

impl std::str::FromStr for RankHome {
    type Err = BridgeError;

    fn from_str(s: &str) -> Result<Self, BridgeError> {
        match s {
            "process" => Ok(RankHome::Process),
            "shared-gpu" => Ok(RankHome::SharedGpu),
            other => Err(BridgeError::Config(format!(
                "ranks: expected \"process\" or \"shared-gpu\", found `{other}`"
            ))),
        }
    }
}

/// The GPU ranks of this process: W = 1 on GPU `gpu` (the caller's current device); for
/// W > 1, this process's rank of a job launched like PyTorch (torchrun's variables; rank 0
/// shares the NCCL id through torchrun's store), or, where `home` is
/// [`RankHome::SharedGpu`], every rank on GPU `gpu`.
///
/// ```
/// use lifecycle_bridge::settings::RankHome;
///
/// assert_eq!("shared-gpu".parse::<RankHome>()?, RankHome::SharedGpu);
/// assert!("nccl".parse::<RankHome>().is_err());
/// # Ok::<(), lifecycle_bridge::BridgeError>(())
/// ```
pub fn gpu_pool(world: usize, gpu: usize, home: RankHome) -> Result<ThreadRankPool, BridgeError> {
    if world == 1 || home == RankHome::SharedGpu {
        return ThreadRankPool::on_devices(&vec![gpu; world]).map_err(BridgeError::backend);
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
