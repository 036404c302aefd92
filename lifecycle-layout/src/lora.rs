//! LoRA adapters in the rollout layout: which linear layers a [`LoraConfig`] adapts, the shapes
//! of each adapter's `A` (`r × in`) and `B` (`out × r`), how they split with their base matrix
//! at tensor-parallel degree `T`, PEFT's names for them, and a PEFT adapter state checked against
//! the model by name before anything moves.
//!
//! The split follows the base: a column-parallel base (q, k, v, gate, up: split on its output
//! rows) splits `B` on its rows and keeps `A` whole on every rank; a row-parallel base (o, down:
//! split on its input columns) splits `A` on its columns and keeps `B` whole. The rank `r` never
//! splits, so each rank's `x·Aᵀ·Bᵀ` is its slice of the whole product (column-parallel) or
//! its partial sum, added with the base's (row-parallel).
//!
//! ```
//! use lifecycle_layout::lora::{adapters, LoraConfig, LoraTarget};
//! use lifecycle_layout::{ModelSpec, Parallel, RolloutLayout};
//!
//! let model = ModelSpec::qwen2_5_7b(28);
//! let lora = LoraConfig::new(64, 128.0, LoraTarget::ALL.to_vec());
//! let specs = adapters(&model, &lora)?;
//! // rank 64 on all seven linear types of 28 layers: ~0.32 GB of bf16 adapters
//! let params: usize = specs.iter().map(|a| a.a.numel() + a.b.numel()).sum();
//! assert_eq!(params, 161_480_704);
//! let q = &specs[0];
//! assert_eq!(q.a.name, "model.layers.0.self_attn.q_proj.lora_A.weight");
//! assert_eq!((q.a.parallel, q.b.parallel), (Parallel::Replicated, Parallel::Column));
//! // adapters split with their bases: at T = 4 every rank holds a quarter of each B (or A)
//! let both = specs.iter().flat_map(|a| [a.a.clone(), a.b.clone()]).collect();
//! let layout = RolloutLayout::new(4, both)?;
//! assert_eq!(layout.tensors()[1].slice_shape(4), vec![3584 / 4, 64]);
//! assert_eq!(lora.scaling(), 2.0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::BTreeMap;
use std::fmt;

use crate::{hf, LayoutError, ModelSpec, Parallel, RolloutFormat, RolloutLayout, TensorSpec};

/// A linear layer type an adapter can target (PEFT's `target_modules` names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LoraTarget {
    /// `self_attn.q_proj`.
    Q,
    /// `self_attn.k_proj`.
    K,
    /// `self_attn.v_proj`.
    V,
    /// `self_attn.o_proj`.
    O,
    /// `mlp.gate_proj`.
    Gate,
    /// `mlp.up_proj`.
    Up,
    /// `mlp.down_proj`.
    Down,
}

impl LoraTarget {
    /// Every target, in a layer's order.
    pub const ALL: [LoraTarget; 7] = [
        LoraTarget::Q,
        LoraTarget::K,
        LoraTarget::V,
        LoraTarget::O,
        LoraTarget::Gate,
        LoraTarget::Up,
        LoraTarget::Down,
    ];

    /// PEFT's module name (`"q_proj"` …).
    pub fn module(self) -> &'static str {
        match self {
            LoraTarget::Q => "q_proj",
            LoraTarget::K => "k_proj",
            LoraTarget::V => "v_proj",
            LoraTarget::O => "o_proj",
            LoraTarget::Gate => "gate_proj",
            LoraTarget::Up => "up_proj",
            LoraTarget::Down => "down_proj",
        }
    }

    /// The target of PEFT module name `name` (`"q_proj"` …).
    pub fn from_module(name: &str) -> Option<LoraTarget> {
        LoraTarget::ALL.into_iter().find(|t| t.module() == name)
    }

    /// The base weight's name in layer `layer` (Hugging Face).
    pub fn base_name(self, layer: usize) -> String {
        let suffix = match self {
            LoraTarget::Q => hf::Q,
            LoraTarget::K => hf::K,
            LoraTarget::V => hf::V,
            LoraTarget::O => hf::O,
            LoraTarget::Gate => hf::GATE,
            LoraTarget::Up => hf::UP,
            LoraTarget::Down => hf::DOWN,
        };
        hf::layer(layer, suffix)
    }

    /// How the base matrix splits in the rollout layout: o and down on their inputs (row),
    /// the others on their outputs (column).
    pub fn base_parallel(self) -> Parallel {
        match self {
            LoraTarget::O | LoraTarget::Down => Parallel::Row,
            _ => Parallel::Column,
        }
    }

    /// Whether the target lives in the MLP (gate, up, down).
    pub fn in_mlp(self) -> bool {
        matches!(self, LoraTarget::Gate | LoraTarget::Up | LoraTarget::Down)
    }

    /// The base matrix's `(out, in)` in `model`.
    fn base_shape(self, model: &ModelSpec) -> (usize, usize) {
        let h = model.hidden;
        match self {
            LoraTarget::Q => (model.q_rows(), h),
            LoraTarget::K | LoraTarget::V => (model.kv_rows(), h),
            LoraTarget::O => (h, model.q_rows()),
            LoraTarget::Gate | LoraTarget::Up => (model.ffn, h),
            LoraTarget::Down => (h, model.ffn),
        }
    }
}

impl fmt::Display for LoraTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.module())
    }
}

/// What of PEFT's `LoraConfig` the layout needs: the rank `r`, `lora_alpha`, rsLoRA, the
/// targets, and the whole tensors trained beside the adapters ([`Trained`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// The rank `r` of every adapter.
    pub rank: usize,
    /// `lora_alpha`.
    pub alpha: f64,
    /// `use_rslora`: scaling `alpha / sqrt(r)` instead of `alpha / r`.
    pub rslora: bool,
    /// The linear layer types adapted (every layer of the model).
    pub targets: Vec<LoraTarget>,
    /// What a frozen base's refresh moves: the adapters and these whole tensors (PEFT's
    /// `modules_to_save`, trainable biases).
    pub trained: Trained,
}

impl LoraConfig {
    /// Rank `rank`, `lora_alpha` `alpha`, plain LoRA scaling, the given targets, the adapters
    /// alone trained.
    pub fn new(rank: usize, alpha: f64, targets: Vec<LoraTarget>) -> Self {
        LoraConfig {
            rank,
            alpha,
            rslora: false,
            targets,
            trained: Trained::default(),
        }
    }

    /// rsLoRA's scaling (`alpha / sqrt(r)`) where `on`.
    pub fn with_rslora(mut self, on: bool) -> Self {
        self.rslora = on;
        self
    }

    /// The whole tensors trained beside the adapters (see [`Trained`]).
    ///
    /// ```
    /// use lifecycle_layout::lora::{LoraConfig, LoraTarget, Trained};
    /// let lora = LoraConfig::new(8, 16.0, vec![LoraTarget::Q])
    ///     .with_trained(Trained::new(["lm_head.weight"]));
    /// assert!(lora.trained.moves("lm_head.weight"));
    /// assert!(lora.trained.moves("model.layers.0.self_attn.q_proj.lora_B.weight"));
    /// assert!(!lora.trained.moves("model.layers.0.self_attn.q_proj.weight"));
    /// ```
    pub fn with_trained(mut self, trained: Trained) -> Self {
        self.trained = trained;
        self
    }

    /// The factor `s` of `y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ`: `alpha / r`, or `alpha / sqrt(r)` with
    /// rsLoRA (PEFT's `scaling`).
    pub fn scaling(&self) -> f64 {
        let r = self.rank as f64;
        if self.rslora {
            self.alpha / r.sqrt()
        } else {
            self.alpha / r
        }
    }
}

/// Which of an adapter's two matrices a tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LoraPart {
    /// `lora_A`: `r × in`.
    A,
    /// `lora_B`: `out × r`.
    B,
}

impl LoraPart {
    fn key(self) -> &'static str {
        match self {
            LoraPart::A => "lora_A",
            LoraPart::B => "lora_B",
        }
    }
}

/// One adapter: the base matrix it changes and its two matrices, each with its split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adapter {
    /// The base weight's Hugging Face name.
    pub base: String,
    /// The decoder layer.
    pub layer: usize,
    /// The linear layer type.
    pub target: LoraTarget,
    /// `lora_A` (`r × in`): split on its columns with a row-parallel base, else whole.
    pub a: TensorSpec,
    /// `lora_B` (`out × r`): split on its rows with a column-parallel base, else whole.
    pub b: TensorSpec,
}

/// The name of part `part` of the adapter of base weight `base` (`…q_proj.weight` →
/// `…q_proj.lora_A.weight`): PEFT's state-dict key without its `base_model.model.` prefix.
pub fn adapter_name(base: &str, part: LoraPart) -> String {
    let module = base.strip_suffix(".weight").unwrap_or(base);
    format!("{module}.{}.weight", part.key())
}

/// The adapters of `lora` over `model`, layer by layer in [`LoraTarget::ALL`]'s order within a
/// layer. Refused by name: a rank of 0, a target listed twice, and MLP targets on a layer of
/// experts (adapters on experts are not supported).
pub fn adapters(model: &ModelSpec, lora: &LoraConfig) -> Result<Vec<Adapter>, LoraError> {
    if lora.rank == 0 {
        return Err(LoraError::Rank);
    }
    if lora.targets.is_empty() {
        return Err(LoraError::NoTargets);
    }
    for (i, t) in lora.targets.iter().enumerate() {
        if lora.targets[..i].contains(t) {
            return Err(LoraError::TargetTwice { target: *t });
        }
    }
    let mut out = Vec::new();
    for layer in 0..model.layers {
        for t in LoraTarget::ALL {
            if !lora.targets.contains(&t) {
                continue;
            }
            if t.in_mlp() && model.moe_layer(layer) {
                return Err(LoraError::Experts { layer, target: t });
            }
            let base = t.base_name(layer);
            let (rows, cols) = t.base_shape(model);
            let (pa, pb) = adapter_splits(t.base_parallel());
            out.push(Adapter {
                a: TensorSpec::new(adapter_name(&base, LoraPart::A), [lora.rank, cols], pa),
                b: TensorSpec::new(adapter_name(&base, LoraPart::B), [rows, lora.rank], pb),
                base,
                layer,
                target: t,
            });
        }
    }
    Ok(out)
}

/// How an adapter's `A` and `B` split beside a base split `base` (see the [module](self)): a
/// column-parallel base splits `B` on its rows, a row-parallel one `A` on its columns; a
/// replicated base (k and v where `T` passes the kv heads) keeps both whole; an owned one puts
/// both on its owner.
pub fn adapter_splits(base: Parallel) -> (Parallel, Parallel) {
    match base {
        Parallel::Column => (Parallel::Replicated, Parallel::Column),
        Parallel::Row => (Parallel::Row, Parallel::Replicated),
        Parallel::Replicated => (Parallel::Replicated, Parallel::Replicated),
        owned @ Parallel::Owned { .. } => (owned, owned),
    }
}

/// `layout` (unfused, Hugging Face names) with the adapters of `lora` over `model` beside their
/// bases, each `A` and `B` split as [`adapter_splits`] says for its base's split in `layout`
/// (so k and v adapters stay whole where `layout` replicates k and v).
///
/// ```
/// use lifecycle_layout::lora::{with_adapters, LoraConfig, LoraTarget};
/// use lifecycle_layout::{ModelSpec, Parallel, RolloutLayout};
/// let model = ModelSpec { vocab: 38, ..ModelSpec::tiny() }; // a vocabulary T = 2 splits
/// let base = RolloutLayout::from_hf_names(2, model.hf_tensors())?;
/// let lora = LoraConfig::new(4, 8.0, vec![LoraTarget::Q, LoraTarget::O]);
/// let layout = with_adapters(&base, &model, &lora)?;
/// let spec = |n: &str| layout.tensors().iter().find(|t| t.name == n).unwrap().parallel;
/// assert_eq!(spec("model.layers.1.self_attn.o_proj.lora_A.weight"), Parallel::Row);
/// assert_eq!(layout.tensors().len(), base.tensors().len() + 2 * 2 * 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn with_adapters(
    layout: &RolloutLayout,
    model: &ModelSpec,
    lora: &LoraConfig,
) -> Result<RolloutLayout, LoraError> {
    if layout.format() != RolloutFormat::Unfused {
        return Err(LoraError::Fused);
    }
    let mut specs = layout.tensors().to_vec();
    for a in adapters(model, lora)? {
        let base = layout
            .tensors()
            .iter()
            .find(|t| t.name == a.base)
            .ok_or_else(|| LoraError::NoBase {
                name: a.base.clone(),
            })?;
        let (pa, pb) = adapter_splits(base.parallel);
        specs.push(TensorSpec {
            parallel: pa,
            ..a.a
        });
        specs.push(TensorSpec {
            parallel: pb,
            ..a.b
        });
    }
    Ok(RolloutLayout::new(layout.tp(), specs)?)
}

/// PEFT's state-dict key `name` read: the base weight it adapts and which matrix it is. Takes
/// `get_peft_model_state_dict`'s keys
/// (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), a model's own `named_parameters` (`…q_proj.lora_A.default.weight`, the adapter's name before
/// `weight`) and this module's [`adapter_name`]s. `None` for a key that is not a LoRA matrix.
///
/// ```
/// use lifecycle_layout::lora::{parse_peft_name, LoraPart};
/// let key = "base_model.model.model.layers.3.mlp.down_proj.lora_B.default.weight";
/// let (base, part) = parse_peft_name(key).unwrap();
/// assert_eq!((base.as_str(), part), ("model.layers.3.mlp.down_proj.weight", LoraPart::B));
/// assert!(parse_peft_name("model.layers.3.mlp.down_proj.weight").is_none());
/// ```
pub fn parse_peft_name(name: &str) -> Option<(String, LoraPart)> {
    let name = name.strip_prefix("base_model.model.").unwrap_or(name);
    let parts: Vec<&str> = name.split('.').collect();
    let at = parts
        .iter()
        .position(|p| *p == "lora_A" || *p == "lora_B")?;
    let part = if parts[at] == "lora_A" {
        LoraPart::A
    } else {
        LoraPart::B
    };
    // after it: `weight`, or an adapter's name then `weight`
    let rest = &parts[at + 1..];
    if !(rest == ["weight"] || (rest.len() == 2 && rest[1] == "weight")) || at == 0 {
        return None;
    }
    Some((format!("{}.weight", parts[..at].join(".")), part))
}

/// Whether tensor `name` is a LoRA matrix ([`parse_peft_name`] reads it).
pub fn is_adapter(name: &str) -> bool {
    parse_peft_name(name).is_some()
}

/// What a LoRA model trains, so what a refresh under a frozen base moves: every LoRA matrix
/// ([`is_adapter`]) and the whole tensors named here, trained beside the adapters (PEFT's
/// `modules_to_save` weights such as `lm_head.weight`, its trainable biases with
/// `bias="all"` / `"lora_only"`). Every other tensor is frozen. Cheap to clone (the names are
/// shared).
///
/// ```
/// use lifecycle_layout::lora::Trained;
/// let trained = Trained::new(["lm_head.weight", "model.layers.0.self_attn.q_proj.bias"]);
/// assert!(trained.moves("lm_head.weight"));
/// assert!(trained.moves("model.layers.1.mlp.down_proj.lora_A.weight")); // an adapter
/// assert!(!trained.moves("model.norm.weight"));
/// assert_eq!(trained.whole().count(), 2);
/// // checked against the model's tensors before anything moves
/// let model = ["lm_head.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.bias"];
/// assert!(trained.check(model).is_ok());
/// let e = Trained::new(["lm_head.bias"]).check(model).unwrap_err().to_string();
/// assert!(e.contains("`lm_head.bias`"), "{e}");
/// assert!(Trained::default().is_empty());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Trained {
    whole: std::sync::Arc<std::collections::BTreeSet<String>>,
}

impl Trained {
    /// The adapters and the whole tensors `names` (each once, whatever the order given).
    pub fn new<S: Into<String>>(names: impl IntoIterator<Item = S>) -> Self {
        Trained {
            whole: std::sync::Arc::new(names.into_iter().map(Into::into).collect()),
        }
    }

    /// Whether tensor `name` is trained: a LoRA matrix, or one of the whole tensors. A refresh
    /// under a frozen base moves exactly these.
    pub fn moves(&self, name: &str) -> bool {
        is_adapter(name) || self.whole.contains(name)
    }

    /// The whole tensors trained beside the adapters, in name order.
    pub fn whole(&self) -> impl Iterator<Item = &str> {
        self.whole.iter().map(String::as_str)
    }

    /// Whether no whole tensor is trained (the adapters alone).
    pub fn is_empty(&self) -> bool {
        self.whole.is_empty()
    }

    /// Checks every whole tensor against `names` (the model's tensors): one it lacks, or a LoRA
    /// matrix (trained as an adapter already), is refused by name.
    pub fn check<'a>(&self, names: impl IntoIterator<Item = &'a str>) -> Result<(), LoraError> {
        if let Some(name) = self.whole.iter().find(|n| is_adapter(n)) {
            return Err(LoraError::TrainedAdapter { name: name.clone() });
        }
        if self.whole.is_empty() {
            return Ok(());
        }
        let mut missing: std::collections::BTreeSet<&str> =
            self.whole.iter().map(String::as_str).collect();
        for n in names {
            missing.remove(n);
            if missing.is_empty() {
                return Ok(());
            }
        }
        match missing.into_iter().next() {
            Some(name) => Err(LoraError::TrainedNotInModel {
                name: name.to_string(),
            }),
            None => Ok(()),
        }
    }

    /// Checks that an fp8 rollout keeping `keep` bf16 quantises none of the whole tensors of
    /// `tensors` (names and full shapes): a frozen base refreshes its trained tensors in bf16,
    /// so one the rollout holds as fp8 is refused by name.
    ///
    /// ```
    /// use lifecycle_layout::fp8::Fp8Keep;
    /// use lifecycle_layout::lora::Trained;
    /// let q = ("model.layers.0.self_attn.q_proj.weight", &[256usize, 256][..]);
    /// let head = ("lm_head.weight", &[1000usize, 256][..]);
    /// assert!(Trained::new(["lm_head.weight"]).check_bf16([q, head], Fp8Keep::default()).is_ok());
    /// let trained = Trained::new([q.0]);
    /// let e = trained.check_bf16([q, head], Fp8Keep::default()).unwrap_err().to_string();
    /// assert!(e.contains("q_proj.weight") && e.contains("fp8"), "{e}");
    /// let attention = Fp8Keep { attention: true, ..Fp8Keep::default() };
    /// assert!(trained.check_bf16([q, head], attention).is_ok());
    /// ```
    pub fn check_bf16<'a>(
        &self,
        tensors: impl IntoIterator<Item = (&'a str, &'a [usize])>,
        keep: crate::fp8::Fp8Keep,
    ) -> Result<(), LoraError> {
        if self.whole.is_empty() {
            return Ok(());
        }
        match tensors
            .into_iter()
            .find(|(n, shape)| self.whole.contains(*n) && !keep.keeps_bf16(n, shape))
        {
            Some((name, _)) => Err(LoraError::TrainedFp8 {
                name: name.to_string(),
            }),
            None => Ok(()),
        }
    }
}

/// Checks a PEFT adapter state (`(name, shape)` of every LoRA tensor, PEFT's keys as
/// [`parse_peft_name`] reads them) against the adapters `lora` puts on `model`: every adapter's
/// A and B present with its shape, nothing else. The first problem is named.
pub fn check_adapter_state(
    model: &ModelSpec,
    lora: &LoraConfig,
    tensors: &[(String, Vec<usize>)],
) -> Result<Vec<Adapter>, LoraError> {
    let want = adapters(model, lora)?;
    let mut given: BTreeMap<(String, LoraPart), (&str, &[usize])> = BTreeMap::new();
    for (name, shape) in tensors {
        let Some(key) = parse_peft_name(name) else {
            return Err(LoraError::NotAdapter { name: name.clone() });
        };
        if given
            .insert(key, (name.as_str(), shape.as_slice()))
            .is_some()
        {
            return Err(LoraError::Twice { name: name.clone() });
        }
    }
    for a in &want {
        for (part, spec) in [(LoraPart::A, &a.a), (LoraPart::B, &a.b)] {
            match given.remove(&(a.base.clone(), part)) {
                None => {
                    return Err(LoraError::Missing {
                        name: spec.name.clone(),
                    })
                }
                Some((name, shape)) if shape != spec.shape.as_slice() => {
                    return Err(LoraError::Shape {
                        name: name.to_string(),
                        expected: spec.shape.clone(),
                        found: shape.to_vec(),
                    })
                }
                Some(_) => {}
            }
        }
    }
    if let Some(((base, _), (name, _))) = given.into_iter().next() {
        let module = base.strip_suffix(".weight").unwrap_or(&base);
        let target = module.rsplit('.').next().unwrap_or(module);
        return Err(match LoraTarget::from_module(target) {
            Some(t) if !lora.targets.contains(&t) => LoraError::Untargeted {
                name: name.to_string(),
                target: t,
            },
            _ => LoraError::NotInModel {
                name: name.to_string(),
            },
        });
    }
    Ok(want)
}

/// A LoRA configuration or adapter state that does not fit the model, named.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoraError {
    /// `r` = 0.
    #[error("LoRA rank r must be at least 1, found 0")]
    Rank,
    /// No target modules.
    #[error("LoRA target_modules is empty: name at least one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj")]
    NoTargets,
    /// A target listed twice.
    #[error("LoRA target `{target}` is listed twice in target_modules")]
    TargetTwice {
        /// The target.
        target: LoraTarget,
    },
    /// MLP adapters on a mixture-of-experts layer.
    #[error("LoRA target `{target}` on layer {layer}, a mixture-of-experts layer: adapters on experts are not supported; leave gate_proj, up_proj and down_proj out of target_modules (or list only attention modules)")]
    Experts {
        /// The layer.
        layer: usize,
        /// The target.
        target: LoraTarget,
    },
    /// A key that is not a LoRA matrix.
    #[error("`{name}` is not a LoRA matrix (expected `<module>.lora_A.weight` or `<module>.lora_B.weight`, PEFT's keys)")]
    NotAdapter {
        /// The key.
        name: String,
    },
    /// The same matrix twice.
    #[error("`{name}` is given twice (as another key of the same module and matrix)")]
    Twice {
        /// The key.
        name: String,
    },
    /// An adapter matrix the configuration needs and the state lacks.
    #[error("adapter matrix `{name}` is missing: the LoRA configuration targets its module")]
    Missing {
        /// The adapter's name.
        name: String,
    },
    /// An adapter matrix whose shape disagrees with its base or the rank.
    #[error(
        "adapter matrix `{name}` has shape {found:?}; its base matrix and rank need {expected:?}"
    )]
    Shape {
        /// The key.
        name: String,
        /// The shape the base and rank give.
        expected: Vec<usize>,
        /// Its shape.
        found: Vec<usize>,
    },
    /// An adapter on a module the configuration does not target.
    #[error("adapter matrix `{name}` adapts `{target}`, which target_modules does not list")]
    Untargeted {
        /// The key.
        name: String,
        /// Its module.
        target: LoraTarget,
    },
    /// An adapter on a module the model does not have.
    #[error("adapter matrix `{name}` adapts a module the model does not have")]
    NotInModel {
        /// The key.
        name: String,
    },
    /// A whole tensor trained beside the adapters ([`Trained`]) that the model lacks.
    #[error("`{name}` is named as trained beside the LoRA adapters (modules_to_save, a trainable bias), and the model has no such tensor")]
    TrainedNotInModel {
        /// The name.
        name: String,
    },
    /// A LoRA matrix named as a whole tensor trained beside the adapters.
    #[error("`{name}` is named as a whole tensor trained beside the LoRA adapters, and it is a LoRA matrix (trained as an adapter already): name base tensors alone")]
    TrainedAdapter {
        /// The name.
        name: String,
    },
    /// A whole tensor trained beside the adapters that an fp8 rollout quantises.
    #[error("`{name}` is trained beside the LoRA adapters, and the fp8 rollout quantises it: a frozen base refreshes its trained tensors in bf16; keep it bf16 (fp8_keep) or roll out bf16")]
    TrainedFp8 {
        /// The name.
        name: String,
    },
    /// A base the rollout layout lacks.
    #[error("base weight `{name}` of a LoRA adapter is not in the rollout layout")]
    NoBase {
        /// The base's name.
        name: String,
    },
    /// The fused layout.
    #[error("LoRA adapters sit beside their bases in the unfused rollout layout (Hugging Face names); the fused (Megatron) layout does not take them yet")]
    Fused,
    /// The layout with the adapters does not split at its degree.
    #[error(transparent)]
    Layout(#[from] LayoutError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RolloutLayout;

    fn tiny_lora(targets: &[LoraTarget]) -> LoraConfig {
        LoraConfig::new(4, 8.0, targets.to_vec())
    }

    #[test]
    fn adapters_split_with_their_base_and_never_on_the_rank() {
        let model = ModelSpec::qwen2_5_7b(2);
        let lora = LoraConfig::new(64, 16.0, LoraTarget::ALL.to_vec()).with_rslora(true);
        assert_eq!(lora.scaling(), 2.0);
        let specs = adapters(&model, &lora).unwrap();
        assert_eq!(specs.len(), 14);
        for a in &specs {
            let (out, inp) = a.target.base_shape(&model);
            assert_eq!(
                (a.a.shape.clone(), a.b.shape.clone()),
                (vec![64, inp], vec![out, 64])
            );
            for t in [1, 2, 4] {
                let layout = RolloutLayout::new(t, vec![a.a.clone(), a.b.clone()]).expect("splits");
                let (sa, sb) = (
                    layout.tensors()[0].slice_shape(t),
                    layout.tensors()[1].slice_shape(t),
                );
                // the rank r stays whole; the base's split dim splits
                assert_eq!((sa[0], sb[1]), (64, 64), "{} at T = {t}", a.base);
                match a.target.base_parallel() {
                    Parallel::Row => assert_eq!((sa[1], sb[0]), (inp / t, out)),
                    _ => assert_eq!((sa[1], sb[0]), (inp, out / t)),
                }
            }
        }
        // T that does not divide a base's split dim: refused by the layout, naming the tensor
        let e = RolloutLayout::new(
            3,
            specs
                .iter()
                .flat_map(|a| [a.a.clone(), a.b.clone()])
                .collect(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("lora_B") || e.contains("lora_A"), "{e}");
    }

    /// Row-major `m[rows × cols]` restricted to `rows × cols` ranges.
    fn slice(
        m: &[f64],
        width: usize,
        (r, c): (std::ops::Range<usize>, std::ops::Range<usize>),
    ) -> Vec<f64> {
        r.flat_map(|i| c.clone().map(move |j| (i, j)))
            .map(|(i, j)| m[i * width + j])
            .collect()
    }

    /// `y[out] = w[out × inp] · x[inp]`.
    fn matvec(w: &[f64], x: &[f64]) -> Vec<f64> {
        w.chunks_exact(x.len())
            .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    }

    /// `W·x + s·B·(A·x)` for each rank's slices, as the ranks of a tensor-parallel group compute
    /// it (a column-parallel base's output rows gathered, a row-parallel base's partial sums
    /// added), equals the whole product: the split rule keeps the adapter's product exact.
    #[test]
    fn each_ranks_slices_give_the_whole_adapted_product() {
        let model = ModelSpec::tiny();
        let lora = LoraConfig::new(3, 6.0, LoraTarget::ALL.to_vec());
        let s = lora.scaling();
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 11) as f64 / (1u64 << 53) as f64) - 0.5
        };
        for a in adapters(&model, &lora)
            .unwrap()
            .into_iter()
            .filter(|a| a.layer == 0)
        {
            let (out, inp) = a.target.base_shape(&model);
            let base = TensorSpec::new(a.base.clone(), [out, inp], a.target.base_parallel());
            let w: Vec<f64> = (0..out * inp).map(|_| next()).collect();
            let am: Vec<f64> = (0..lora.rank * inp).map(|_| next()).collect();
            let bm: Vec<f64> = (0..out * lora.rank).map(|_| next()).collect();
            let x: Vec<f64> = (0..inp).map(|_| next()).collect();
            let whole: Vec<f64> = {
                let ax = matvec(&am, &x);
                matvec(&w, &x)
                    .iter()
                    .zip(matvec(&bm, &ax))
                    .map(|(y, d)| y + s * d)
                    .collect()
            };
            for t in [2, 4] {
                let mut got = vec![0.0; out];
                for rank in 0..t {
                    let (wr, wc) = base.tp_slice(t, rank);
                    let ws = slice(&w, inp, (wr.clone(), wc.clone()));
                    let as_ = slice(&am, inp, a.a.tp_slice(t, rank));
                    let bs = slice(&bm, lora.rank, a.b.tp_slice(t, rank));
                    let xs = &x[wc.clone()];
                    let ax = matvec(&as_, xs);
                    let y: Vec<f64> = matvec(&ws, xs)
                        .iter()
                        .zip(matvec(&bs, &ax))
                        .map(|(y, d)| y + s * d)
                        .collect();
                    for (o, v) in wr.zip(y) {
                        got[o] += v; // gathered rows, or summed partial sums
                    }
                }
                for (g, w) in got.iter().zip(&whole) {
                    assert!((g - w).abs() < 1e-12, "{} at T = {t}: {g} vs {w}", a.base);
                }
            }
        }
    }

    #[test]
    fn peft_names_read_back_to_their_base() {
        let model = ModelSpec::tiny();
        for a in adapters(&model, &tiny_lora(&LoraTarget::ALL)).unwrap() {
            for (part, spec) in [(LoraPart::A, &a.a), (LoraPart::B, &a.b)] {
                let peft = format!("base_model.model.{}", spec.name);
                assert_eq!(parse_peft_name(&peft), Some((a.base.clone(), part)));
                let named = spec.name.replace(".weight", ".default.weight");
                assert_eq!(parse_peft_name(&named), Some((a.base.clone(), part)));
            }
        }
        for bad in [
            "lora_A.weight",
            "model.layers.0.self_attn.q_proj.lora_A.bias",
            "x.lora_C.weight",
        ] {
            assert_eq!(parse_peft_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn an_adapter_state_that_does_not_fit_is_refused_by_name() {
        let model = ModelSpec::tiny();
        let lora = tiny_lora(&[LoraTarget::Q, LoraTarget::Down]);
        let good: Vec<(String, Vec<usize>)> = adapters(&model, &lora)
            .unwrap()
            .iter()
            .flat_map(|a| {
                [
                    (format!("base_model.model.{}", a.a.name), a.a.shape.clone()),
                    (a.b.name.clone(), a.b.shape.clone()),
                ]
            })
            .collect();
        assert_eq!(check_adapter_state(&model, &lora, &good).unwrap().len(), 4);
        let err = |tensors: &[(String, Vec<usize>)]| {
            check_adapter_state(&model, &lora, tensors)
                .unwrap_err()
                .to_string()
        };
        // a missing B
        let e = err(&good[..good.len() - 1]);
        assert!(
            e.contains("model.layers.1.mlp.down_proj.lora_B.weight") && e.contains("missing"),
            "{e}"
        );
        // a B of the wrong rank
        let mut bad = good.clone();
        bad[1].1 = vec![16, 8];
        let e = err(&bad);
        assert!(
            e.contains("q_proj.lora_B") && e.contains("[16, 8]") && e.contains("[16, 4]"),
            "{e}"
        );
        // an adapter on a module the configuration does not target
        let mut extra = good.clone();
        extra.push((
            "model.layers.0.self_attn.k_proj.lora_A.weight".into(),
            vec![4, 16],
        ));
        let e = err(&extra);
        assert!(e.contains("k_proj") && e.contains("target_modules"), "{e}");
        // on a layer the model lacks
        let mut extra = good.clone();
        extra.push((
            "model.layers.9.self_attn.q_proj.lora_A.weight".into(),
            vec![4, 16],
        ));
        assert!(err(&extra).contains("does not have"));
        // a key that is not an adapter matrix
        let mut extra = good;
        extra.push((
            "model.layers.0.self_attn.q_proj.weight".into(),
            vec![16, 16],
        ));
        assert!(err(&extra).contains("not a LoRA matrix"));
    }

    #[test]
    fn trained_whole_tensors_move_beside_the_adapters_and_bad_names_are_refused() {
        let model = ModelSpec::tiny();
        let names: Vec<String> = model.hf_tensors().into_iter().map(|(n, _)| n).collect();
        let all = || names.iter().map(String::as_str);
        let biases: Vec<&str> = all().filter(|n| n.ends_with(".bias")).collect();
        assert_eq!(biases.len(), 3 * model.layers);
        let trained = Trained::new(biases.iter().copied().chain(["lm_head.weight"]));
        assert!(trained.check(all()).is_ok());
        let moving: Vec<&str> = all().filter(|n| trained.moves(n)).collect();
        assert_eq!(moving.len(), biases.len() + 1);
        assert!(!trained.moves("model.embed_tokens.weight"));
        assert!(trained.moves("model.layers.1.mlp.up_proj.lora_B.weight"));
        // the same names twice are one
        assert_eq!(Trained::new(["a", "a"]).whole().collect::<Vec<_>>(), ["a"]);
        let e = |t: Trained| t.check(all()).unwrap_err();
        let adapter = "model.layers.0.self_attn.q_proj.lora_A.weight";
        assert_eq!(
            e(Trained::new(["lm_head.weight", adapter])),
            LoraError::TrainedAdapter {
                name: adapter.into()
            }
        );
        let missing = e(Trained::new([
            "lm_head.weight",
            "model.layers.2.self_attn.q_proj.bias",
        ]));
        assert_eq!(
            missing,
            LoraError::TrainedNotInModel {
                name: "model.layers.2.self_attn.q_proj.bias".into()
            }
        );
        assert!(missing.to_string().contains("no such tensor"));
        // with no model tensors at all, the first trained name is the one missing
        assert!(Trained::new(["x"]).check([]).is_err());
        assert!(Trained::default().check([]).is_ok());
    }

    #[test]
    fn bad_configurations_are_refused_by_name() {
        let model = ModelSpec::tiny();
        let e = |l: LoraConfig| adapters(&model, &l).unwrap_err().to_string();
        assert!(e(LoraConfig::new(0, 8.0, vec![LoraTarget::Q])).contains("rank r"));
        assert!(e(tiny_lora(&[])).contains("target_modules is empty"));
        assert!(e(tiny_lora(&[LoraTarget::V, LoraTarget::V])).contains("`v_proj` is listed twice"));
        let moe = ModelSpec::qwen3_30b_a3b(2);
        assert!(adapters(&moe, &tiny_lora(&[LoraTarget::Q, LoraTarget::O])).is_ok());
        let e = adapters(&moe, &tiny_lora(&[LoraTarget::Up]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("layer 0") && e.contains("experts"), "{e}");
    }
}
