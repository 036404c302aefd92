//! The rollout weights' dtype ([`RolloutDtype`]) and which matrices an fp8 rollout keeps bf16
//! ([`keeps_bf16`], [`Fp8Keep`]).

use crate::LayoutError;

/// The element type of the rollout weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RolloutDtype {
    /// Every tensor in bf16, cast from the fp32 masters (round to nearest even).
    #[default]
    Bf16,
    /// Block-scaled e4m3 for the matrices [`keeps_bf16`] does not exempt, quantised from the
    /// fp32 masters in the switch; the exempt tensors in bf16.
    Fp8,
}

impl RolloutDtype {
    /// The setting's name: `bf16` or `fp8`.
    pub fn name(self) -> &'static str {
        match self {
            RolloutDtype::Bf16 => "bf16",
            RolloutDtype::Fp8 => "fp8",
        }
    }
}

impl std::fmt::Display for RolloutDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for RolloutDtype {
    type Err = String;

    /// `bf16` or `fp8`.
    ///
    /// ```
    /// use lifecycle_layout::fp8::RolloutDtype;
    /// assert_eq!("fp8".parse::<RolloutDtype>(), Ok(RolloutDtype::Fp8));
    /// assert!("fp16".parse::<RolloutDtype>().unwrap_err().contains("bf16 or fp8"));
    /// ```
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "bf16" => Ok(RolloutDtype::Bf16),
            "fp8" => Ok(RolloutDtype::Fp8),
            other => Err(format!(
                "unknown rollout dtype `{other}`: expected bf16 or fp8"
            )),
        }
    }
}

/// Whether tensor `name` of shape `shape` stays bf16 in an fp8 rollout, by the published
/// defaults (DeepSeek-V3, Qwen3-FP8): 1-D tensors (norms, biases), the embedding, the output
/// head, the MoE router and LoRA adapters stay bf16; every other matrix (attention and MLP
/// projections, experts) is quantised.
///
/// ```
/// use lifecycle_layout::fp8::keeps_bf16;
/// assert!(keeps_bf16("model.embed_tokens.weight", &[151936, 2048]));
/// assert!(keeps_bf16("model.layers.0.mlp.gate.weight", &[128, 2048]));
/// assert!(keeps_bf16("model.layers.0.input_layernorm.weight", &[2048]));
/// assert!(!keeps_bf16("model.layers.0.mlp.experts.3.down_proj.weight", &[2048, 768]));
/// // LoRA adapters stay bf16 beside an fp8 base, as engines serve them
/// assert!(keeps_bf16("model.layers.0.mlp.down_proj.lora_A.weight", &[64, 18944]));
/// ```
pub fn keeps_bf16(name: &str, shape: &[usize]) -> bool {
    shape.len() < 2
        || name == crate::hf::EMBED
        || name == crate::hf::LM_HEAD
        || name.ends_with(crate::hf::ROUTER)
        || name.ends_with(crate::hf::SHARED_EXPERT_GATE)
        || crate::lora::parse_peft_name(name).is_some()
}

/// Which matrices an fp8 rollout keeps in bf16 beyond the published exemptions of
/// [`keeps_bf16`] (1-D tensors, the embedding, the head and the router always stay bf16): the
/// attention projections, and every matrix of chosen decoder layers (recipes that keep the first
/// and last layers in higher precision). The default keeps nothing more: the published fp8
/// checkpoints' choice. Parsed from a comma-separated list of `attention` and `layer:N`
/// (`none` or empty for the default).
///
/// ```
/// use lifecycle_layout::fp8::Fp8Keep;
/// let keep: Fp8Keep = "attention,layer:0".parse()?;
/// assert!(keep.keeps_bf16("model.layers.5.self_attn.q_proj.weight", &[64, 64]));
/// assert!(keep.keeps_bf16("model.layers.0.mlp.down_proj.weight", &[64, 64]));
/// assert!(!keep.keeps_bf16("model.layers.5.mlp.down_proj.weight", &[64, 64]));
/// assert!(Fp8Keep::default().keeps_bf16("lm_head.weight", &[64, 64]));
/// assert!("layer:200".parse::<Fp8Keep>().is_err());
/// # Ok::<(), String>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Fp8Keep {
    /// Keep q, k, v and o projections bf16.
    pub attention: bool,
    /// Keep every matrix of these decoder layers bf16.
    pub layers: crate::LayerSet,
}

impl Fp8Keep {
    /// Checks the layers it keeps against a model's tensor names (`model.layers.N.…`): a layer
    /// the model lacks is [`LayoutError::Fp8KeepLayer`].
    ///
    /// ```
    /// use lifecycle_layout::fp8::Fp8Keep;
    /// let names = ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"];
    /// let keep: Fp8Keep = "layer:1".parse()?;
    /// assert!(keep.check_layers(names).is_ok());
    /// let keep: Fp8Keep = "layer:2".parse()?;
    /// assert!(keep.check_layers(names).unwrap_err().to_string().contains("numbered 0 to 1"));
    /// # Ok::<(), String>(())
    /// ```
    pub fn check_layers<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
    ) -> Result<(), LayoutError> {
        let kept = self.layers.layers();
        if kept.is_empty() {
            return Ok(());
        }
        let layers = names
            .into_iter()
            .filter_map(|n| {
                n.strip_prefix("model.layers.")?
                    .split('.')
                    .next()?
                    .parse()
                    .ok()
            })
            .map(|l: usize| l + 1)
            .max()
            .unwrap_or(0);
        match kept.into_iter().find(|&l| l >= layers) {
            Some(layer) => Err(LayoutError::Fp8KeepLayer { layer, layers }),
            None => Ok(()),
        }
    }

    /// Whether tensor `name` of shape `shape` stays bf16: [`keeps_bf16`], or chosen here.
    pub fn keeps_bf16(&self, name: &str, shape: &[usize]) -> bool {
        if keeps_bf16(name, shape) {
            return true;
        }
        let layer = name
            .strip_prefix("model.layers.")
            .and_then(|rest| rest.split('.').next())
            .and_then(|l| l.parse::<usize>().ok());
        (self.attention && name.contains(".self_attn."))
            || layer.is_some_and(|l| self.layers.contains(l))
    }
}

impl std::fmt::Display for Fp8Keep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        if self.attention {
            parts.push("attention".into());
        }
        parts.extend(self.layers.layers().iter().map(|l| format!("layer:{l}")));
        if parts.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&parts.join(","))
        }
    }
}

impl std::str::FromStr for Fp8Keep {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut keep = Fp8Keep::default();
        let mut layers = Vec::new();
        for part in s
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty() && *p != "none")
        {
            match part.strip_prefix("layer:") {
                _ if part == "attention" => keep.attention = true,
                Some(l) => layers.push(l.parse::<usize>().map_err(|_| {
                    format!("fp8 keep `{part}`: expected layer:N with N a layer index")
                })?),
                None => {
                    return Err(format!(
                        "fp8 keep `{part}`: expected attention, layer:N or none"
                    ))
                }
            }
        }
        keep.layers = crate::LayerSet::from_layers(&layers)
            .map_err(|l| format!("fp8 keep layer:{l}: layers are numbered below 128"))?;
        Ok(keep)
    }
}
