//! The model configuration: read from a Hugging Face `config.json` (transformers 4.x and 5.x
//! spellings), the tensors it implies, and the rollout layout for a tensor-parallel degree.

use std::path::Path;

use crate::{ExpertPlacement, LayerSet, ModelSpec, MoeSpec, Parallel, RolloutLayout, TensorSpec};
use serde_json::{Map, Value};

use crate::error::{ConfigError, LayoutError};

/// Which family of decoder-only transformer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Qwen2: q/k/v projections carry biases.
    Qwen2,
    /// Llama (and Mistral-style configs): q/k/v biases only when `attention_bias` is true.
    Llama,
    /// Qwen3: q/k RMS norms per head, biases only when `attention_bias` is true.
    Qwen3,
    /// Qwen3-MoE: Qwen3 attention and a mixture-of-experts MLP ([`MoeSpec`]).
    Qwen3Moe,
    /// Qwen2-MoE: Qwen2 attention (q/k/v biases) and a mixture-of-experts MLP with a shared
    /// expert behind a sigmoid gate ([`MoeSpec::shared_ffn`]).
    Qwen2Moe,
}

/// Spelling of `config.json` to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigStyle {
    /// transformers 4.x: top-level `rope_theta`, `torch_dtype`.
    V4,
    /// transformers 5.x: `rope_parameters { rope_type, rope_theta }`, `dtype`.
    V5,
}

/// Sizes and constants of a Qwen2 / Llama model.
///
/// ```
/// use lifecycle_layout::ModelConfig;
/// let json = r#"{"model_type": "qwen2", "vocab_size": 61, "hidden_size": 32,
///   "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
///   "num_key_value_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
///   "dtype": "float32", "tie_word_embeddings": true}"#;
/// let config = ModelConfig::from_json_str(json)?;
/// assert_eq!((config.model.head_dim, config.rope_theta), (8, 10000.0));
/// // 61 is not divisible by 2: the embedding is replicated, not vocabulary-parallel
/// let layout = config.rollout_layout(2)?;
/// assert!(layout.tensors().iter().any(|t| t.name == "model.embed_tokens.weight"
///     && t.parallel == lifecycle_layout::Parallel::Replicated));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Model family.
    pub architecture: Architecture,
    /// The model's shapes: the one description the planners, the rollout layouts, the decoders
    /// and `lifecycle-plan` read (its Megatron vocabulary padding is the default 128; see
    /// [`ModelConfig::model_spec`] for another).
    pub model: ModelSpec,
    /// Rotary base.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Storage dtype the config names (`dtype` or `torch_dtype`), if any.
    pub dtype: Option<String>,
}

fn field_err(field: &'static str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        field,
        problem: problem.into(),
    }
}

fn get_usize(map: &Map<String, Value>, field: &'static str) -> Result<Option<usize>, ConfigError> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(0) => Err(field_err(field, "must be at least 1, found 0")),
            Some(n) => usize::try_from(n)
                .map(Some)
                .map_err(|_| field_err(field, format!("{n} is too large"))),
            None => Err(field_err(
                field,
                format!("must be a positive integer, found {v}"),
            )),
        },
    }
}

fn need_usize(map: &Map<String, Value>, field: &'static str) -> Result<usize, ConfigError> {
    get_usize(map, field)?
        .ok_or_else(|| field_err(field, "missing (a positive integer is required)"))
}

fn get_f64(map: &Map<String, Value>, field: &'static str) -> Result<Option<f64>, ConfigError> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() && x > 0.0 => Ok(Some(x)),
            _ => Err(field_err(
                field,
                format!("must be a positive number, found {v}"),
            )),
        },
    }
}

fn get_bool(map: &Map<String, Value>, field: &'static str) -> Result<Option<bool>, ConfigError> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(field_err(
            field,
            format!("must be true or false, found {v}"),
        )),
    }
}

fn get_str<'a>(
    map: &'a Map<String, Value>,
    field: &'static str,
) -> Result<Option<&'a str>, ConfigError> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(field_err(field, format!("must be a string, found {v}"))),
    }
}

/// The rotary base from either spelling; plain (unscaled) rope only.
fn rope_theta(map: &Map<String, Value>) -> Result<f64, ConfigError> {
    let check_type = |params: &Map<String, Value>, field: &'static str| match params
        .get("rope_type")
        .or_else(|| params.get("type"))
    {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(t)) if t == "default" => Ok(()),
        Some(t) => Err(field_err(
            field,
            format!("rope_type {t} is not supported (only plain rope, \"default\")"),
        )),
    };
    if let Some(scaling) = map.get("rope_scaling").and_then(Value::as_object) {
        check_type(scaling, "rope_scaling")?;
    }
    let nested = match map.get("rope_parameters") {
        None | Some(Value::Null) => None,
        Some(Value::Object(params)) => {
            check_type(params, "rope_parameters")?;
            match params.get("rope_theta") {
                None | Some(Value::Null) => None,
                Some(v) => match v.as_f64() {
                    Some(x) if x.is_finite() && x > 0.0 => Some(x),
                    _ => {
                        return Err(field_err(
                            "rope_parameters",
                            format!("rope_theta must be a positive number, found {v}"),
                        ))
                    }
                },
            }
        }
        Some(v) => {
            return Err(field_err(
                "rope_parameters",
                format!("must be an object, found {v}"),
            ))
        }
    };
    match (nested, get_f64(map, "rope_theta")?) {
        (Some(a), Some(b)) if a != b => Err(field_err(
            "rope_theta",
            format!("top-level rope_theta {b} disagrees with rope_parameters.rope_theta {a}"),
        )),
        (Some(a), _) => Ok(a),
        (None, Some(b)) => Ok(b),
        (None, None) => Err(field_err(
            "rope_theta",
            "missing: give rope_parameters.rope_theta (transformers 5.x) or rope_theta (4.x)",
        )),
    }
}

/// The model types [`ModelConfig`] reads, for messages.
const SUPPORTED: &str =
    "\"qwen2\", \"llama\", \"mistral\", \"qwen3\", \"qwen3_moe\" or \"qwen2_moe\"";

/// The mixture-of-experts fields of a Qwen3-MoE or Qwen2-MoE `config.json` (`num_experts`, or
/// `num_local_experts` as transformers 5 writes it; Qwen2-MoE's shared expert).
fn moe_spec(map: &Map<String, Value>, shared: bool) -> Result<MoeSpec, ConfigError> {
    let experts = match (
        get_usize(map, "num_experts")?,
        get_usize(map, "num_local_experts")?,
    ) {
        (Some(a), Some(b)) if a != b => {
            return Err(field_err(
                "num_experts",
                format!("{a} disagrees with num_local_experts {b}"),
            ))
        }
        (Some(n), _) | (None, Some(n)) => n,
        (None, None) => {
            return Err(field_err(
                "num_experts",
                "missing (or num_local_experts): a qwen3_moe config needs its expert count",
            ))
        }
    };
    let top_k = need_usize(map, "num_experts_per_tok")?;
    if top_k > experts {
        return Err(field_err(
            "num_experts_per_tok",
            format!(
                "{top_k} exceeds num_experts {experts}: a token is routed to at most every expert"
            ),
        ));
    }
    let dense = match map.get("mlp_only_layers") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_u64().map(|n| n as usize).ok_or_else(|| {
                    field_err(
                        "mlp_only_layers",
                        format!("must hold layer indices, found {v}"),
                    )
                })
            })
            .collect::<Result<_, _>>()?,
        Some(v) => {
            return Err(field_err(
                "mlp_only_layers",
                format!("must be a list of layer indices, found {v}"),
            ))
        }
    };
    let dense_layers = LayerSet::from_layers(&dense).map_err(|l| {
        field_err(
            "mlp_only_layers",
            format!("layer {l} is past the 128 layers supported"),
        )
    })?;
    let shared_ffn = match (shared, get_usize(map, "shared_expert_intermediate_size")?) {
        (true, Some(n)) => n,
        (true, None) => {
            return Err(field_err(
                "shared_expert_intermediate_size",
                "missing: a qwen2_moe config needs the shared expert's size (0 for none)",
            ))
        }
        (false, Some(n)) if n > 0 => {
            return Err(field_err(
                "shared_expert_intermediate_size",
                format!("{n}: a qwen3_moe model has no shared expert (use model_type qwen2_moe)"),
            ))
        }
        (false, _) => 0,
    };
    Ok(MoeSpec {
        experts,
        top_k,
        ffn: need_usize(map, "moe_intermediate_size")?,
        norm_topk_prob: get_bool(map, "norm_topk_prob")?.unwrap_or(false),
        sparse_step: get_usize(map, "decoder_sparse_step")?.unwrap_or(1),
        dense_layers,
        shared_ffn,
    })
}

impl ModelConfig {
    /// Parses the text of a Hugging Face `config.json`.
    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        let value: Value = serde_json::from_str(text).map_err(|e| ConfigError::Json {
            path: "config.json".into(),
            message: e.to_string(),
        })?;
        let map = value.as_object().ok_or_else(|| ConfigError::Json {
            path: "config.json".into(),
            message: "the top level is not a JSON object".into(),
        })?;
        Self::from_map(map)
    }

    /// Reads `path` (a `config.json`).
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text).map_err(|e| match e {
            ConfigError::Json { message, .. } => ConfigError::Json {
                path: path.to_path_buf(),
                message,
            },
            other => other,
        })
    }

    fn from_map(map: &Map<String, Value>) -> Result<Self, ConfigError> {
        // a config without `model_type` (vLLM's fixtures, some exports) names its class
        let model_type = match get_str(map, "model_type")? {
            Some(t) => t,
            None => match map.get("architectures").and_then(|a| a.get(0)?.as_str()) {
                Some("Qwen2ForCausalLM") => "qwen2",
                Some("LlamaForCausalLM") => "llama",
                Some("MistralForCausalLM") => "mistral",
                Some("Qwen3ForCausalLM") => "qwen3",
                Some("Qwen3MoeForCausalLM") => "qwen3_moe",
                Some("Qwen2MoeForCausalLM") => "qwen2_moe",
                _ => "",
            },
        };
        let architecture = match model_type {
            "qwen2" => Architecture::Qwen2,
            "llama" | "mistral" => Architecture::Llama,
            "qwen3" => Architecture::Qwen3,
            "qwen3_moe" => Architecture::Qwen3Moe,
            "qwen2_moe" => Architecture::Qwen2Moe,
            "" => return Err(field_err("model_type", format!("missing ({SUPPORTED})"))),
            other => {
                return Err(field_err(
                    "model_type",
                    format!("\"{other}\" is not supported ({SUPPORTED})"),
                ))
            }
        };
        if let Some(act) = get_str(map, "hidden_act")?
            && act != "silu"
        {
            return Err(field_err(
                "hidden_act",
                format!("\"{act}\" is not supported (SwiGLU uses \"silu\")"),
            ));
        }
        if get_bool(map, "mlp_bias")? == Some(true) {
            return Err(field_err("mlp_bias", "MLP biases are not supported"));
        }
        let hidden_size = need_usize(map, "hidden_size")?;
        let num_heads = need_usize(map, "num_attention_heads")?;
        let num_kv_heads = get_usize(map, "num_key_value_heads")?.unwrap_or(num_heads);
        if num_heads % num_kv_heads != 0 {
            return Err(field_err(
                "num_key_value_heads",
                format!("{num_kv_heads} does not divide num_attention_heads {num_heads}"),
            ));
        }
        let head_dim = match get_usize(map, "head_dim")? {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(field_err(
                    "head_dim",
                    format!("missing, and hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads}"),
                ))
            }
        };
        if head_dim % 2 != 0 {
            return Err(field_err(
                "head_dim",
                format!("{head_dim} is odd: rotary embeddings need an even head size"),
            ));
        }
        let qkv_bias = match architecture {
            Architecture::Qwen2 => true,
            Architecture::Qwen2Moe => get_bool(map, "qkv_bias")?.unwrap_or(true),
            _ => get_bool(map, "attention_bias")?.unwrap_or(false),
        };
        let moe = match architecture {
            Architecture::Qwen3Moe => Some(moe_spec(map, false)?),
            Architecture::Qwen2Moe => Some(moe_spec(map, true)?),
            _ => None,
        };
        let intermediate_size = match (get_usize(map, "intermediate_size")?, moe) {
            (Some(n), _) => n,
            // a MoE model without dense layers needs no dense intermediate size
            (None, Some(m)) if m.dense_layers == LayerSet::EMPTY && m.sparse_step == 1 => m.ffn,
            (None, _) => need_usize(map, "intermediate_size")?,
        };
        let dtype = match get_str(map, "dtype")? {
            Some(d) => Some(d.to_string()),
            None => get_str(map, "torch_dtype")?.map(str::to_string),
        };
        Ok(ModelConfig {
            architecture,
            model: ModelSpec {
                hidden: hidden_size,
                heads: num_heads,
                query_groups: num_kv_heads,
                head_dim,
                ffn: intermediate_size,
                vocab: need_usize(map, "vocab_size")?,
                layers: need_usize(map, "num_hidden_layers")?,
                qkv_bias,
                tied_embeddings: get_bool(map, "tie_word_embeddings")?.unwrap_or(false),
                make_vocab_size_divisible_by: 128,
                qk_norm: matches!(architecture, Architecture::Qwen3 | Architecture::Qwen3Moe),
                moe,
            },
            rope_theta: rope_theta(map)?,
            rms_norm_eps: get_f64(map, "rms_norm_eps")?.unwrap_or(1e-6),
            dtype,
        })
    }

    /// The config as `config.json` text in `style`.
    ///
    /// ```
    /// use lifecycle_layout::{ConfigStyle, ModelConfig};
    /// let c = ModelConfig::from_json_str(r#"{"model_type": "llama", "vocab_size": 8,
    ///   "hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1,
    ///   "num_attention_heads": 2, "rope_parameters": {"rope_theta": 500.0}}"#)?;
    /// let v4 = c.to_json(ConfigStyle::V4);
    /// assert!(v4.contains("\"rope_theta\": 500.0") && v4.contains("torch_dtype"));
    /// assert_eq!(ModelConfig::from_json_str(&v4)?, ModelConfig { dtype: Some("float32".into()), ..c });
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn to_json(&self, style: ConfigStyle) -> String {
        let mut map = Map::new();
        let (model_type, arch) = match self.architecture {
            Architecture::Qwen2 => ("qwen2", "Qwen2ForCausalLM"),
            Architecture::Llama => ("llama", "LlamaForCausalLM"),
            Architecture::Qwen3 => ("qwen3", "Qwen3ForCausalLM"),
            Architecture::Qwen3Moe => ("qwen3_moe", "Qwen3MoeForCausalLM"),
            Architecture::Qwen2Moe => ("qwen2_moe", "Qwen2MoeForCausalLM"),
        };
        map.insert("model_type".into(), model_type.into());
        map.insert("architectures".into(), Value::Array(vec![arch.into()]));
        for (k, v) in [
            ("vocab_size", self.model.vocab),
            ("hidden_size", self.model.hidden),
            ("intermediate_size", self.model.ffn),
            ("num_hidden_layers", self.model.layers),
            ("num_attention_heads", self.model.heads),
            ("num_key_value_heads", self.model.query_groups),
            ("head_dim", self.model.head_dim),
        ] {
            map.insert(k.into(), v.into());
        }
        map.insert("hidden_act".into(), "silu".into());
        map.insert("rms_norm_eps".into(), self.rms_norm_eps.into());
        map.insert(
            "tie_word_embeddings".into(),
            self.model.tied_embeddings.into(),
        );
        match self.architecture {
            Architecture::Qwen2 => {}
            Architecture::Qwen2Moe => {
                map.insert("qkv_bias".into(), self.model.qkv_bias.into());
            }
            _ => {
                map.insert("attention_bias".into(), self.model.qkv_bias.into());
            }
        }
        if let Some(m) = self.model.moe {
            for (k, v) in [
                ("num_experts", m.experts),
                ("num_experts_per_tok", m.top_k),
                ("moe_intermediate_size", m.ffn),
                ("decoder_sparse_step", m.sparse_step),
            ] {
                map.insert(k.into(), v.into());
            }
            if self.architecture == Architecture::Qwen2Moe {
                let (k, v) = ("shared_expert_intermediate_size", m.shared_ffn);
                map.insert(k.into(), v.into());
            }
            map.insert("norm_topk_prob".into(), m.norm_topk_prob.into());
            map.insert(
                "mlp_only_layers".into(),
                m.dense_layers
                    .layers()
                    .into_iter()
                    .map(Value::from)
                    .collect(),
            );
        }
        let dtype: Value = self
            .dtype
            .clone()
            .unwrap_or_else(|| "float32".into())
            .into();
        match style {
            ConfigStyle::V4 => {
                map.insert("rope_theta".into(), self.rope_theta.into());
                map.insert("torch_dtype".into(), dtype);
            }
            ConfigStyle::V5 => {
                let mut rope = Map::new();
                rope.insert("rope_type".into(), "default".into());
                rope.insert("rope_theta".into(), self.rope_theta.into());
                map.insert("rope_parameters".into(), Value::Object(rope));
                map.insert("dtype".into(), dtype);
            }
        }
        serde_json::to_string_pretty(&Value::Object(map)).unwrap_or_default()
    }

    /// The Megatron-Core description of this model: `num_attention_heads` → heads,
    /// `num_key_value_heads` → query groups, `head_dim` → kv channels, `intermediate_size` →
    /// ffn hidden size, `hidden_size`, `vocab_size`, `num_hidden_layers`, q/k/v biases (Qwen2,
    /// or Llama's `attention_bias`), `tie_word_embeddings` → shared embedding and output layer.
    /// The rotary base, norm epsilon and dtype do not change the layout and are not carried.
    ///
    /// ```
    /// use lifecycle_layout::ModelConfig;
    /// let config = ModelConfig::from_json_str(r#"{"model_type": "qwen2", "vocab_size": 61,
    ///   "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2, "head_dim": 16,
    ///   "num_attention_heads": 4, "num_key_value_heads": 1, "rope_theta": 10000.0,
    ///   "tie_word_embeddings": true}"#)?;
    /// let spec = config.model_spec(128);
    /// assert_eq!((spec.heads, spec.query_groups, spec.head_dim, spec.ffn), (4, 1, 16, 80));
    /// assert!(spec.qkv_bias && spec.tied_embeddings);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn model_spec(&self, make_vocab_size_divisible_by: usize) -> ModelSpec {
        ModelSpec {
            make_vocab_size_divisible_by,
            ..self.model
        }
    }

    /// Every parameter with its full shape, Hugging Face names, in checkpoint order.
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.model_spec(128).hf_tensors()
    }

    /// Parameter count.
    pub fn params(&self) -> usize {
        self.tensor_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }

    /// The rollout layout at tensor-parallel degree `tp`, choosing each split the way vLLM does:
    /// q, gate and up column-parallel (heads and the intermediate size must divide by `tp`); k and
    /// v column-parallel when the kv heads divide by `tp`, otherwise, when `tp` is a multiple of
    /// the kv heads, replicated (vLLM's rule: every rank keeps kv head `r / (T / kv_heads)`; the
    /// layout cannot express "one head of several on each rank", so each rank holds all kv heads
    /// and uses its own); o and down row-parallel; embedding and head vocabulary-parallel when the
    /// vocabulary divides by `tp`, replicated otherwise; norms replicated.
    pub fn rollout_layout(&self, tp: usize) -> Result<RolloutLayout, LayoutError> {
        self.rollout_layout_with(tp, ExpertPlacement::TensorParallel)
    }

    /// [`ModelConfig::rollout_layout`] with the experts of a mixture-of-experts model placed by
    /// `experts`: split by TP inside every expert, or partitioned over the ranks (rank `r` holds
    /// experts `[r·E/T, (r+1)·E/T)` whole; `T` must divide `num_experts`). The router is
    /// replicated either way; dense models ignore the setting.
    ///
    /// ```
    /// use lifecycle_layout::ModelConfig;
    /// use lifecycle_layout::{ExpertPlacement, Parallel};
    /// let c = ModelConfig::from_json_str(r#"{"model_type": "qwen3_moe", "vocab_size": 64,
    ///   "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 4,
    ///   "num_key_value_heads": 2, "head_dim": 8, "rope_theta": 10000.0, "num_experts": 6,
    ///   "num_experts_per_tok": 2, "moe_intermediate_size": 8}"#)?;
    /// let ep = c.rollout_layout_with(2, ExpertPlacement::Partitioned)?;
    /// assert_eq!(ep.owner("model.layers.0.mlp.experts.4.gate_proj.weight"), Some(1));
    /// // 6 experts do not partition over 4 ranks: the error names num_experts
    /// let err = c.rollout_layout_with(4, ExpertPlacement::Partitioned).unwrap_err();
    /// assert!(err.to_string().contains("num_experts"), "{err}");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn rollout_layout_with(
        &self,
        tp: usize,
        experts: ExpertPlacement,
    ) -> Result<RolloutLayout, LayoutError> {
        let degree = |reason: String| LayoutError::Split { tp, reason };
        if tp == 0 {
            return Err(degree("T must be at least 1".into()));
        }
        if !self.model.heads.is_multiple_of(tp) {
            return Err(degree(format!(
                "num_attention_heads {} is not divisible by T: choose T dividing it",
                self.model.heads
            )));
        }
        if let Some(m) = self.model.moe {
            if experts == ExpertPlacement::Partitioned && !m.experts.is_multiple_of(tp) {
                return Err(degree(format!(
                    "num_experts {} is not divisible by T: expert parallelism gives every rank \
                     the same number of whole experts; choose T dividing it, or split every \
                     expert by tensor parallelism (ExpertPlacement::TensorParallel)",
                    m.experts
                )));
            }
            if experts == ExpertPlacement::TensorParallel && !m.ffn.is_multiple_of(tp) {
                return Err(degree(format!(
                    "moe_intermediate_size {} is not divisible by T: choose T dividing it (the \
                     experts are split by tensor parallelism inside every expert)",
                    m.ffn
                )));
            }
        }
        if let Some(m) = self.model.moe
            && !m.shared_ffn.is_multiple_of(tp)
        {
            return Err(degree(format!(
                "shared_expert_intermediate_size {} is not divisible by T: choose T dividing \
                     it (the shared expert is split by tensor parallelism like a dense MLP)",
                m.shared_ffn
            )));
        }
        let dense_mlp = (0..self.model.layers).any(|l| !self.model_spec(128).moe_layer(l));
        if dense_mlp && !self.model.ffn.is_multiple_of(tp) {
            return Err(degree(format!(
                "intermediate_size {} is not divisible by T: choose T dividing it",
                self.model.ffn
            )));
        }
        let kv_split = if self.model.query_groups.is_multiple_of(tp) {
            Parallel::Column
        } else if tp.is_multiple_of(self.model.query_groups) {
            Parallel::Replicated
        } else {
            return Err(degree(format!(
                "num_key_value_heads {} neither divides by T nor divides T (vLLM needs one of them)",
                self.model.query_groups
            )));
        };
        let vocab_split = if self.model.vocab.is_multiple_of(tp) {
            Parallel::Column
        } else {
            Parallel::Replicated
        };
        let specs = self
            .tensor_shapes()
            .into_iter()
            .map(|(name, shape)| {
                let parallel = if name.contains("k_proj") || name.contains("v_proj") {
                    kv_split
                } else if name.contains("embed_tokens") || name.starts_with("lm_head") {
                    vocab_split
                } else {
                    Parallel::for_hf_name(&name)
                };
                TensorSpec::new(name, shape, parallel)
            })
            .collect();
        let specs = match self.model.moe {
            Some(m) => experts.apply(specs, m.experts, tp)?,
            None => specs,
        };
        RolloutLayout::new(tp, specs)
    }
}
