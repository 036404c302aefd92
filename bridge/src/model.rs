//! The model a trainer's tensors must be: its config, and the trainer's parameter names and
//! full shapes checked against it, by name, before anything is read.

use std::collections::{HashMap, HashSet};

use lifecycle_layout::lora::{adapters, with_adapters, LoraConfig, LoraPart};
use lifecycle_layout::megatron::{MegatronLayout, MegatronParallel};
use lifecycle_layout::ModelConfig;
use lifecycle_layout::{ExpertPlacement, FsdpLayout, RolloutLayout};

use crate::error::BridgeError;
use crate::settings;

/// A trainer's parameters bound to a model config: every name the config has, each once, with
/// the config's full shape, in the trainer's order (which becomes the training order).
///
/// ```
/// use lifecycle_bridge::ModelBinding;
/// let config = r#"{"model_type": "qwen2", "vocab_size": 16, "hidden_size": 8,
///   "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
///   "intermediate_size": 16, "rope_theta": 10000.0, "tie_word_embeddings": true}"#;
/// let mut named = lifecycle_bridge::ModelBinding::expected(config)?;
/// let binding = ModelBinding::new(config, named.clone())?;
/// assert_eq!(binding.names().len(), named.len());
/// // a wrong shape is refused by name
/// named[0].1 = vec![17, 8];
/// let err = ModelBinding::new(config, named).unwrap_err();
/// assert!(err.to_string().contains("model.embed_tokens.weight"), "{err}");
/// # Ok::<(), lifecycle_bridge::BridgeError>(())
/// ```
#[derive(Debug, Clone)]
pub struct ModelBinding {
    config: ModelConfig,
    names: Vec<(String, Vec<usize>)>,
    /// LoRA adapters beside the base ([`ModelBinding::with_lora`]).
    lora: Option<LoraConfig>,
    /// Frozen base tensors the rollout reads where the trainer keeps them
    /// ([`ModelBinding::with_shared`]), in the trainer's order: not in `names`.
    shared: Vec<(String, Vec<usize>)>,
}

impl ModelBinding {
    /// The parameters (Hugging Face names, full shapes, checkpoint order) of the model
    /// `config_json` (a Hugging Face `config.json`) describes.
    pub fn expected(config_json: &str) -> Result<Vec<(String, Vec<usize>)>, BridgeError> {
        Ok(parse(config_json)?.tensor_shapes())
    }

    /// vLLM's runtime parameters (names and rank-local shapes, `named_parameters()` order) of
    /// the model `config_json` describes at tensor-parallel degree `tp`
    /// ([`lifecycle_layout::vllm::vllm_names`]), `experts` and `dtype` the settings' names
    /// (`"tp"` / `"ep"`, `"bf16"` / `"fp8"`).
    ///
    /// ```
    /// use lifecycle_bridge::ModelBinding;
    /// let config = r#"{"model_type": "qwen3", "vocab_size": 100, "hidden_size": 16,
    ///   "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    ///   "head_dim": 8, "intermediate_size": 32, "rope_theta": 10000.0}"#;
    /// let names = ModelBinding::vllm_names(config, 1, "tp", "bf16")?;
    /// assert_eq!(names[1].0, "model.layers.0.self_attn.qkv_proj.weight");
    /// let err = ModelBinding::vllm_names(config, 1, "dp", "bf16").unwrap_err();
    /// assert!(err.to_string().contains("experts"), "{err}");
    /// # Ok::<(), lifecycle_bridge::BridgeError>(())
    /// ```
    pub fn vllm_names(
        config_json: &str,
        tp: usize,
        experts: &str,
        dtype: &str,
    ) -> Result<Vec<(String, Vec<usize>)>, BridgeError> {
        let (experts, dtype) = (settings::experts(experts)?, settings::dtype(dtype)?);
        let config = parse(config_json)?;
        lifecycle_layout::vllm::vllm_names(&config, tp, experts, dtype)
            .map_err(|e| BridgeError::Config(e.to_string()))
    }

    /// Binds `named` (the trainer's parameter names and full shapes) to the model of
    /// `config_json`: a name the model lacks, a shape that differs, a name given twice and a
    /// name missing are refused, each naming the tensor.
    pub fn new(config_json: &str, named: Vec<(String, Vec<usize>)>) -> Result<Self, BridgeError> {
        let config = parse(config_json)?;
        let expected = config.tensor_shapes();
        Self::bind(config, expected, named, None)
    }

    /// The parameters of the model `config_json` describes with the LoRA adapters of `lora`
    /// (each adapted base weight's `lora_A` (`r × in`) and `lora_B` (`out × r`) right after it,
    /// named as PEFT names them without its `base_model.model.` prefix); an adapter on an
    /// expert layer's MLP, `r` = 0 and repeated targets refused by name.
    ///
    /// ```
    /// use lifecycle_bridge::ModelBinding;
    /// use lifecycle_layout::lora::{LoraConfig, LoraTarget};
    /// let config = r#"{"model_type": "qwen2", "vocab_size": 16, "hidden_size": 8,
    ///   "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    ///   "intermediate_size": 16, "rope_theta": 10000.0, "tie_word_embeddings": true}"#;
    /// let lora = LoraConfig::new(2, 4.0, vec![LoraTarget::Q]);
    /// let named = ModelBinding::expected_with_lora(config, &lora)?;
    /// let at = named.iter().position(|(n, _)| n == "model.layers.0.self_attn.q_proj.weight").unwrap();
    /// assert_eq!(named[at + 1], ("model.layers.0.self_attn.q_proj.lora_A.weight".into(), vec![2, 8]));
    /// assert_eq!(named[at + 2], ("model.layers.0.self_attn.q_proj.lora_B.weight".into(), vec![8, 2]));
    /// let binding = ModelBinding::with_lora(config, named, lora)?;
    /// assert!(binding.lora().is_some());
    /// # Ok::<(), lifecycle_bridge::BridgeError>(())
    /// ```
    pub fn expected_with_lora(
        config_json: &str,
        lora: &LoraConfig,
    ) -> Result<Vec<(String, Vec<usize>)>, BridgeError> {
        let config = parse(config_json)?;
        Self::shapes_with_lora(&config, lora)
    }

    fn shapes_with_lora(
        config: &ModelConfig,
        lora: &LoraConfig,
    ) -> Result<Vec<(String, Vec<usize>)>, BridgeError> {
        let list = adapters(&config.model_spec(128), lora)
            .map_err(|e| BridgeError::Config(format!("LoRA: {e}")))?;
        let mut out = Vec::new();
        for (name, shape) in config.tensor_shapes() {
            let adapted = list.iter().find(|a| a.base == name);
            out.push((name, shape));
            if let Some(a) = adapted {
                for spec in [&a.a, &a.b] {
                    out.push((spec.name.clone(), spec.shape.clone()));
                }
            }
        }
        Ok(out)
    }

    /// [`ModelBinding::new`] for a model with the LoRA adapters of `lora` beside its base
    /// ([`ModelBinding::expected_with_lora`] lists them): every base weight but the whole
    /// tensors `lora.trained` names is frozen (a switch casts it once and refreshes the adapters
    /// and those tensors alone), the rollout holds each adapter beside its base, split as its
    /// base is. A trained name the model lacks, or that is an adapter, is refused by name.
    ///
    /// ```
    /// use lifecycle_bridge::ModelBinding;
    /// use lifecycle_layout::lora::{LoraConfig, LoraTarget, Trained};
    /// let config = r#"{"model_type": "qwen2", "vocab_size": 16, "hidden_size": 8,
    ///   "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    ///   "intermediate_size": 16, "rope_theta": 10000.0, "tie_word_embeddings": false}"#;
    /// let lora = LoraConfig::new(2, 4.0, vec![LoraTarget::Q]);
    /// let named = ModelBinding::expected_with_lora(config, &lora)?;
    /// let head = lora.clone().with_trained(Trained::new(["lm_head.weight"]));
    /// assert!(ModelBinding::with_lora(config, named.clone(), head).is_ok());
    /// let typo = lora.with_trained(Trained::new(["lm_head.weights"]));
    /// let e = ModelBinding::with_lora(config, named, typo).unwrap_err().to_string();
    /// assert!(e.contains("`lm_head.weights`"), "{e}");
    /// # Ok::<(), lifecycle_bridge::BridgeError>(())
    /// ```
    pub fn with_lora(
        config_json: &str,
        named: Vec<(String, Vec<usize>)>,
        lora: LoraConfig,
    ) -> Result<Self, BridgeError> {
        let config = parse(config_json)?;
        let expected = Self::shapes_with_lora(&config, &lora)?;
        Self::bind(config, expected, named, Some(lora))
    }

    fn bind(
        config: ModelConfig,
        expected_list: Vec<(String, Vec<usize>)>,
        named: Vec<(String, Vec<usize>)>,
        lora: Option<LoraConfig>,
    ) -> Result<Self, BridgeError> {
        let expected: HashMap<String, Vec<usize>> = expected_list.iter().cloned().collect();
        let mut seen = HashSet::new();
        for (name, shape) in &named {
            let Some(want) = expected.get(name) else {
                let why = match lifecycle_layout::lora::parse_peft_name(name) {
                    Some((_, part)) if lora.is_none() => format!(
                        "a LoRA {} matrix, and the switch was given no LoRA configuration: \
                         pass lora=... (r, lora_alpha, target_modules)",
                        if part == LoraPart::A { "A" } else { "B" }
                    ),
                    Some(_) => "a LoRA matrix of a module the LoRA configuration does not \
                                target, or of one the model lacks"
                        .to_string(),
                    None => format!(
                        "not a parameter of this {:?} model (its {} parameters are Hugging \
                         Face names such as `model.layers.0.self_attn.q_proj.weight`; pass the \
                         module whose config this is)",
                        config.architecture,
                        expected.len()
                    ),
                };
                return Err(BridgeError::tensor(name, why));
            };
            if want != shape {
                return Err(BridgeError::tensor(
                    name,
                    format!("the model config gives shape {want:?}, the module's is {shape:?}"),
                ));
            }
            if !seen.insert(name.as_str()) {
                return Err(BridgeError::tensor(name, "given twice"));
            }
        }
        let missing: Vec<&String> = expected_list
            .iter()
            .map(|(n, _)| n)
            .filter(|n| !seen.contains(n.as_str()))
            .collect();
        if let Some(first) = missing.first() {
            return Err(BridgeError::tensor(
                first.as_str(),
                match missing.len() {
                    1 => "missing from the module: pass every parameter the config describes, \
                          frozen and tied ones included"
                        .to_string(),
                    n => format!(
                        "missing from the module, with {} more of the model's parameters: pass \
                         every parameter the config describes, frozen and tied ones included",
                        n - 1
                    ),
                },
            ));
        }
        if let Some(lora) = &lora {
            lora.trained
                .check(named.iter().map(|(n, _)| n.as_str()))
                .map_err(|e| BridgeError::Config(format!("lora: {e}")))?;
        }
        Ok(ModelBinding {
            config,
            names: named,
            lora,
            shared: Vec::new(),
        })
    }

    /// The same binding with the frozen base tensors `names` read in place by the rollout
    /// (a LoRA model's bf16 base on one GPU: the device holds it once): taken out of
    /// [`ModelBinding::names`] (the switch neither lends nor moves them) into
    /// [`ModelBinding::shared`]. Refused by name: a name the binding lacks or gives twice, an
    /// adapter, a tensor trained beside the adapters, and any name without LoRA adapters.
    ///
    /// ```
    /// use lifecycle_bridge::ModelBinding;
    /// use lifecycle_layout::lora::{LoraConfig, LoraTarget};
    /// let config = r#"{"model_type": "qwen2", "vocab_size": 16, "hidden_size": 8,
    ///   "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    ///   "intermediate_size": 16, "rope_theta": 10000.0, "tie_word_embeddings": true}"#;
    /// let lora = LoraConfig::new(2, 4.0, vec![LoraTarget::Q]);
    /// let named = ModelBinding::expected_with_lora(config, &lora)?;
    /// let q = "model.layers.0.self_attn.q_proj.weight".to_string();
    /// let binding = ModelBinding::with_lora(config, named.clone(), lora.clone())?.with_shared(&[q.clone()])?;
    /// assert_eq!(binding.shared()[0].0, q);
    /// assert_eq!(binding.names().len(), named.len() - 1);
    /// // the whole model's layout still has it; the switch's does not
    /// assert!(binding.whole_rollout_layout()?.tensors().iter().any(|t| t.name == q));
    /// let a = "model.layers.0.self_attn.q_proj.lora_A.weight".to_string();
    /// let e = ModelBinding::with_lora(config, named, lora)?.with_shared(&[a]).unwrap_err();
    /// assert!(e.to_string().contains("an adapter"), "{e}");
    /// # Ok::<(), lifecycle_bridge::BridgeError>(())
    /// ```
    pub fn with_shared(mut self, names: &[String]) -> Result<Self, BridgeError> {
        for name in names {
            let refuse = |why: &str| BridgeError::tensor(name, format!("shared base: {why}"));
            let Some(lora) = &self.lora else {
                return Err(refuse(
                    "only a LoRA model's frozen base is read in place (from_peft)",
                ));
            };
            if lifecycle_layout::lora::parse_peft_name(name).is_some() {
                return Err(refuse(
                    "an adapter moves at every refresh, it is not frozen",
                ));
            }
            if lora.trained.moves(name) {
                return Err(refuse("trained beside the adapters, it is not frozen"));
            }
            let Some(at) = self.names.iter().position(|(n, _)| n == name) else {
                return Err(refuse("not a tensor of the model, or given twice"));
            };
            let tensor = self.names.remove(at);
            self.shared.push(tensor);
        }
        Ok(self)
    }

    /// The frozen base tensors the rollout reads in place ([`ModelBinding::with_shared`]).
    pub fn shared(&self) -> &[(String, Vec<usize>)] {
        &self.shared
    }

    /// The LoRA configuration, where the model has adapters.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// The model config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Names and full shapes of the tensors the switch lends, in the trainer's order (the
    /// shared ones left out).
    pub fn names(&self) -> &[(String, Vec<usize>)] {
        &self.names
    }

    /// The FSDP training layout over `world` ranks (dim-0 chunks, as FSDP2's `Shard(0)`).
    pub fn train_layout(&self, world: usize) -> Result<FsdpLayout, BridgeError> {
        FsdpLayout::new(world, self.names.iter().cloned()).map_err(BridgeError::backend)
    }

    /// The rollout layout the switch writes at tensor-parallel degree `tp` with the experts
    /// placed by `experts`: the whole model's, the shared tensors left out.
    pub fn rollout_layout(
        &self,
        tp: usize,
        experts: ExpertPlacement,
    ) -> Result<RolloutLayout, BridgeError> {
        let whole = self.whole_layout(tp, experts)?;
        if self.shared.is_empty() {
            return Ok(whole);
        }
        let kept = whole
            .tensors()
            .iter()
            .filter(|t| !self.shared.iter().any(|(n, _)| *n == t.name))
            .cloned()
            .collect();
        RolloutLayout::new(tp, kept).map_err(|e| BridgeError::Config(e.to_string()))
    }

    /// The whole model's rollout layout at `T = 1`, the shared tensors included: what an engine
    /// over a shared base reads.
    pub fn whole_rollout_layout(&self) -> Result<RolloutLayout, BridgeError> {
        self.whole_layout(1, ExpertPlacement::TensorParallel)
    }

    fn whole_layout(
        &self,
        tp: usize,
        experts: ExpertPlacement,
    ) -> Result<RolloutLayout, BridgeError> {
        let base = self
            .config
            .rollout_layout_with(tp, experts)
            .map_err(|e| BridgeError::Config(e.to_string()))?;
        match &self.lora {
            None => Ok(base),
            Some(lora) => with_adapters(&base, &self.config.model_spec(128), lora)
                .map_err(|e| BridgeError::Config(format!("LoRA: {e}"))),
        }
    }
}

impl ModelBinding {
    /// Megatron-Core's training layout of this model at `parallel`'s degrees (EP and ETP
    /// included), the embedding padded to `padded_vocab` rows (the live model's `vocab_size`),
    /// or where `None` by Megatron's default rule (a multiple of 128 × TP).
    pub fn megatron_layout(
        &self,
        parallel: MegatronParallel,
        padded_vocab: Option<usize>,
    ) -> Result<MegatronLayout, BridgeError> {
        let spec = self
            .config
            .model_spec(parallel.make_vocab_size_divisible_by);
        MegatronLayout::at(spec, parallel, padded_vocab)
            .map_err(|e| BridgeError::Config(e.to_string()))
    }

    /// Megatron-Core's parameters of global rank `rank` of the model `config_json` (a Hugging
    /// Face `config.json`) trained at `parallel` ([`ModelBinding::megatron_layout`]): names as
    /// its local spec registers them, the rank's shapes, in the order a Megatron switch lends
    /// them. What `Switch.from_megatron` checks a live model against.
    ///
    /// ```
    /// use lifecycle_bridge::ModelBinding;
    /// use lifecycle_bridge::MegatronParallel;
    /// let config = r#"{"model_type": "qwen2", "vocab_size": 100, "hidden_size": 16,
    ///   "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    ///   "intermediate_size": 32, "rope_theta": 10000.0, "tie_word_embeddings": false}"#;
    /// let names = ModelBinding::megatron_parameters(config, MegatronParallel::new(1, 1, 1), None, 0)?;
    /// assert_eq!(names[0], ("embedding.word_embeddings.weight".to_string(), vec![128, 16]));
    /// assert!(names.iter().any(|(n, s)| n.ends_with("linear_qkv.weight") && s == &[32, 16]));
    /// # Ok::<(), lifecycle_bridge::BridgeError>(())
    /// ```
    pub fn megatron_parameters(
        config_json: &str,
        parallel: MegatronParallel,
        padded_vocab: Option<usize>,
        rank: usize,
    ) -> Result<Vec<(String, Vec<usize>)>, BridgeError> {
        let binding = ModelBinding::new(config_json, ModelBinding::expected(config_json)?)?;
        let layout = binding.megatron_layout(parallel, padded_vocab)?;
        if rank >= layout.world() {
            return Err(BridgeError::Config(format!(
                "rank {rank}: TP × PP × DP = {} ranks",
                layout.world()
            )));
        }
        Ok(layout
            .stage_slots(layout.coords(rank).pp)
            .iter()
            .map(|s| (s.name.clone(), s.shape.clone()))
            .collect())
    }

    /// The training layout over `world` ranks and the rollout layout at `tp` with `experts`,
    /// checked against each other as a switch will plan them (T divides W, every tensor placed):
    /// what a constructor can refuse before anything is read.
    pub fn layouts(
        &self,
        world: usize,
        tp: usize,
        experts: ExpertPlacement,
    ) -> Result<(FsdpLayout, RolloutLayout), BridgeError> {
        let train = self.train_layout(world)?;
        let rollout = self.rollout_layout(tp, experts)?;
        lifecycle_layout::plan_fsdp_to_tp(&train, &rollout)
            .map_err(|e| BridgeError::Config(e.to_string()))?;
        Ok((train, rollout))
    }
}

fn parse(config_json: &str) -> Result<ModelConfig, BridgeError> {
    ModelConfig::from_json_str(config_json)
        .map_err(|e| BridgeError::Config(format!("model config: {e}")))
}
