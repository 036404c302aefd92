//! [`Switch`]: the one switch a front (the Python package) drives, over host arrays (the CPU
//! reference backend) or lent GPU tensors (FSDP2 shards or Megatron-Core parameters), or
//! closed. Every call is decided here, once, so a
//! front converts its arguments and calls through without asking which kind it holds.

use std::sync::Arc;

use lifecycle_cuda::ThreadRankPool;
use lifecycle_layout::megatron::MegatronParallel;

use crate::error::BridgeError;
use crate::gpu::{GpuFront, GpuRankParts, GpuSwitch};
use crate::host::HostSwitch;
use crate::model::ModelBinding;
use crate::settings::SwitchSettings;
use crate::shards::Shard;
use crate::shared::SharedWatch;
use crate::switch::{Entered, SwitchStats};
use crate::views::{Leases, TensorView};

/// A switch over host arrays or lent GPU shards, or closed ([`Switch::close`]), and the weight
/// versions its last enter saw: whether a rollout call switches or reuses the resident weights
/// is decided here ([`Switch::changed`], [`Switch::reuse`], [`Switch::enter`]), not by the front.
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
pub struct Switch {
    kind: Kind,
    /// The versions of the trainer's tensors at the last successful enter (`None`: none yet).
    seen: Option<Vec<u64>>,
    /// The shared base's watch, where the binding has one ([`ModelBinding::with_shared`]).
    shared: Option<SharedWatch>,
}

/// What a [`Switch`] switches over.
enum Kind {
    /// Over host arrays, on the CPU reference backend.
    Host(Box<HostSwitch>),
    /// Over lent GPU tensors (either kind: [`GpuFront`]).
    Gpu(Box<dyn GpuFront>),
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
    /// ranks `pool` makes, called only for it). A binding with a shared base
    /// ([`ModelBinding::with_shared`]) needs `"cuda"`:
    ///
    /// ```
    /// use lifecycle_bridge::{ModelBinding, Switch, SwitchSettings};
    /// use lifecycle_layout::lora::{LoraConfig, LoraTarget};
    /// let config = r#"{"model_type": "qwen2", "vocab_size": 16, "hidden_size": 8,
    ///   "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    ///   "intermediate_size": 16, "rope_theta": 10000.0, "tie_word_embeddings": true}"#;
    /// let lora = LoraConfig::new(2, 4.0, vec![LoraTarget::Q]);
    /// let named = ModelBinding::expected_with_lora(config, &lora)?;
    /// let norm = "model.norm.weight".to_string();
    /// let binding = ModelBinding::with_lora(config, named, lora)?.with_shared(&[norm])?;
    /// let err = Switch::build(binding, SwitchSettings::new(1, 1), "cpu", || unreachable!()).err().unwrap();
    /// assert!(err.to_string().contains("`model.norm.weight`"), "{err}");
    /// # Ok::<(), lifecycle_bridge::BridgeError>(())
    /// ```
    pub fn build(
        binding: ModelBinding,
        settings: SwitchSettings,
        device: &str,
        pool: impl FnOnce() -> Result<ThreadRankPool, BridgeError>,
    ) -> Result<Self, BridgeError> {
        if let (Some((name, _)), "cpu") = (binding.shared().first(), device) {
            return Err(BridgeError::tensor(
                name,
                "a frozen base read in place needs the GPU switch (device \"cuda\"); the \
                 reference backend switches fp32 tensors",
            ));
        }
        let names: Vec<String> = binding.shared().iter().map(|(n, _)| n.clone()).collect();
        let shared = (!names.is_empty()).then(|| SharedWatch::new(names));
        let kind = match device {
            "cpu" => Kind::Host(Box::new(HostSwitch::new(binding, settings)?)),
            "cuda" => Kind::Gpu(Box::new(GpuSwitch::new(
                binding,
                settings,
                Arc::new(pool()?),
            )?)),
            other => {
                return Err(BridgeError::Config(format!(
                    "device `{other}`: expected \"cpu\" (the reference backend) or \"cuda\""
                )))
            }
        };
        Ok(Switch {
            kind,
            seen: None,
            shared,
        })
    }

    /// A switch of Megatron-Core parameters for the model `config_json` (a Hugging Face
    /// `config.json`) trained at `parallel`'s degrees with the embedding padded to
    /// `padded_vocab` rows (the live model's), with the settings `text` names (its `world` TP × PP × DP, its
    /// `tp` the rollout's), on the GPU ranks `pool` makes ([`GpuSwitch::megatron`]).
    ///
    /// ```
    /// use lifecycle_bridge::settings::SettingsText;
    /// use lifecycle_bridge::Switch;
    /// let config = r#"{"model_type": "qwen2", "vocab_size": 16, "hidden_size": 8,
    ///   "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    ///   "intermediate_size": 16, "rope_theta": 10000.0, "tie_word_embeddings": true}"#;
    /// let text = SettingsText { world: 2, tp: 1, dtype: "bf16", experts: "tp",
    ///     offload: "none", switching: "lazy", fp8_keep: "none" };
    /// let no_gpu = || Err(lifecycle_bridge::BridgeError::Config("no GPU here".into()));
    /// // refused before any GPU is asked for: W = 2 given for TP × PP × DP = 1
    /// let degrees = lifecycle_bridge::MegatronParallel::new(1, 1, 1);
    /// let err = Switch::megatron(config, degrees, 16, &text, no_gpu).err().unwrap();
    /// assert!(err.to_string().contains("TP × PP × DP"), "{err}");
    /// ```
    pub fn megatron(
        config_json: &str,
        parallel: MegatronParallel,
        padded_vocab: usize,
        text: &crate::settings::SettingsText<'_>,
        pool: impl FnOnce() -> Result<ThreadRankPool, BridgeError>,
    ) -> Result<Self, BridgeError> {
        let MegatronParallel { tp, pp, dp, .. } = parallel;
        if parallel.world() != text.world {
            return Err(BridgeError::Config(format!(
                "world size {} given for Megatron's TP × PP × DP = {tp} × {pp} × {dp}",
                text.world
            )));
        }
        let binding = ModelBinding::new(config_json, ModelBinding::expected(config_json)?)?;
        let settings = crate::settings::switch_settings(text, binding.names(), binding.lora())?;
        let train = binding.megatron_layout(parallel, Some(padded_vocab))?;
        let gpu = GpuSwitch::megatron(binding, train, settings, Arc::new(pool()?))?;
        Ok(Switch {
            kind: Kind::Gpu(Box::new(gpu)),
            seen: None,
            shared: None,
        })
    }

    /// The Megatron-Core names and shapes local rank `local` lends, in the order
    /// [`Switch::enter`] takes them (a Megatron switch only).
    pub fn parameters(&self, local: usize) -> Result<crate::gpu::Named, BridgeError> {
        match &self.kind {
            Kind::Gpu(s) => s.parameters(local),
            Kind::Host(_) => Err(BridgeError::Config(
                "parameters lists what a Megatron switch lends; this switch is on the CPU".into(),
            )),
            Kind::Closed => Err(closed()),
        }
    }

    /// The handed-out views' leases (empty for a closed switch).
    pub fn leases(&self) -> Arc<Leases> {
        match &self.kind {
            Kind::Host(s) => s.leases().clone(),
            Kind::Gpu(s) => s.leases().clone(),
            Kind::Closed => Arc::new(Leases::default()),
        }
    }

    /// Checks shards as [`Switch::enter`] would, reading nothing.
    pub fn check_shards(&self, shards: &[Vec<Shard>]) -> Result<(), BridgeError> {
        match &self.kind {
            Kind::Host(s) => s.check_shards(shards),
            Kind::Gpu(s) => s.check_shards(shards),
            Kind::Closed => Err(closed()),
        }
    }

    /// Enters rollout mode from what is lent per rank ([`HostSwitch::enter`] reads only the
    /// shards; [`GpuSwitch::enter`] also the offload buffers and the stream). The weights
    /// switch when [`Switch::changed`] says so for `versions` and `refresh`; otherwise the
    /// resident ones are reused unless the shards moved (the kind compares where they are
    /// lent). On success `versions` are the ones the next call compares with.
    ///
    /// # Safety
    /// As the kind's `enter` says: host shards point to that many fp32 values readable for the
    /// call; GPU shards are live fp32 device memory kept alive as [`GpuSwitch::enter`] states.
    pub unsafe fn enter(
        &mut self,
        lent: Vec<GpuRankParts>,
        versions: Vec<u64>,
        refresh: bool,
    ) -> Result<Entered, BridgeError> {
        let changed = self.changed(&versions, refresh);
        let entered = match &mut self.kind {
            Kind::Host(s) => {
                let shards: Vec<Vec<Shard>> = lent.into_iter().map(|p| p.shards).collect();
                // SAFETY: forwarded to the caller.
                unsafe { s.enter(&shards, changed) }
            }
            Kind::Gpu(s) => {
                let written = self
                    .seen
                    .as_deref()
                    .and_then(|seen| s.frozen_written(seen, &versions));
                // SAFETY: forwarded to the caller.
                unsafe { s.enter(lent, changed, written) }
            }
            Kind::Closed => Err(closed()),
        }?;
        self.seen = Some(versions);
        Ok(entered)
    }

    /// Checks the shared base before a rollout ([`SharedWatch::check`]: `versions` the front's
    /// tuple of each shared tensor's versions, `addresses` where each one's parameter is now);
    /// nothing to check without one.
    pub fn check_shared(&mut self, versions: &[u64], addresses: &[u64]) -> Result<(), BridgeError> {
        if matches!(self.kind, Kind::Closed) {
            return Err(closed());
        }
        match &mut self.shared {
            Some(w) => w.check(versions, addresses),
            None => Ok(()),
        }
    }

    /// Whether the trainer's weights changed since the last enter: `refresh` (the front's
    /// word: a write the versions do not show), no enter yet, or `versions` other than the
    /// ones that enter saw.
    pub fn changed(&self, versions: &[u64], refresh: bool) -> bool {
        refresh || self.seen.as_deref() != Some(versions)
    }

    /// A rollout call on the resident weights where nothing changed ([`Switch::changed`]) and
    /// the shards cannot have moved (`may_have_moved` false: the front restored no storage);
    /// `None` when [`Switch::enter`], with the shards, is needed.
    pub fn reuse(
        &mut self,
        versions: &[u64],
        refresh: bool,
        may_have_moved: bool,
    ) -> Result<Option<Entered>, BridgeError> {
        if self.changed(versions, refresh) || may_have_moved {
            return match self.kind {
                Kind::Closed => Err(closed()),
                _ => Ok(None),
            };
        }
        match &mut self.kind {
            Kind::Host(s) => s.reuse_current(),
            Kind::Gpu(s) => s.reuse_current(),
            Kind::Closed => Err(closed()),
        }
    }

    /// The rollout tensors of local rank `local`.
    pub fn views(&mut self, local: usize) -> Result<Vec<TensorView>, BridgeError> {
        match &mut self.kind {
            Kind::Host(s) => s.views(local),
            Kind::Gpu(s) => s.views(local),
            Kind::Closed => Err(closed()),
        }
    }

    /// Leaves rollout mode (refused while handed-out views are referenced).
    pub fn exit(&mut self) -> Result<(), BridgeError> {
        match &mut self.kind {
            Kind::Host(s) => s.exit(),
            Kind::Gpu(s) => s.exit_for("exit"),
            Kind::Closed => Err(closed()),
        }
    }

    /// Leaves rollout mode and closes the switch (refused while handed-out views are
    /// referenced; a closed switch stays closed): the switch that was, for the caller to drop
    /// where it may (a GPU switch holds the front's callables).
    pub fn close(&mut self) -> Result<Switch, BridgeError> {
        let closed = || Switch {
            kind: Kind::Closed,
            seen: None,
            shared: None,
        };
        match &mut self.kind {
            Kind::Host(s) => s.exit_for("close")?,
            Kind::Gpu(s) => s.exit_for("close")?,
            Kind::Closed => return Ok(closed()),
        }
        Ok(std::mem::replace(self, closed()))
    }

    /// Whether [`Switch::close`] ran.
    pub fn is_closed(&self) -> bool {
        matches!(self.kind, Kind::Closed)
    }

    /// Counts and times of the switches so far.
    pub fn stats(&self) -> Result<SwitchStats, BridgeError> {
        match &self.kind {
            Kind::Host(s) => Ok(s.stats()),
            Kind::Gpu(s) => Ok(s.stats()),
            Kind::Closed => Err(closed()),
        }
    }

    /// The ranks whose rollout tensors this process reads: the rollout ranks `0..T` of a host
    /// switch, the global ranks this process drives on the GPU.
    pub fn local_ranks(&self) -> Result<Vec<usize>, BridgeError> {
        match &self.kind {
            Kind::Host(s) => Ok(s.rollout_ranks().collect()),
            Kind::Gpu(s) => s.local_ranks(),
            Kind::Closed => Err(closed()),
        }
    }

    /// The GPU switch, for what only it does (the engine), or why there is none.
    pub fn gpu(&mut self) -> Result<&mut dyn GpuFront, BridgeError> {
        match &mut self.kind {
            Kind::Gpu(s) => Ok(s.as_mut()),
            Kind::Host(_) => Err(BridgeError::Config(
                "the project's GPU engine needs a switch on device \"cuda\"; this one is on \
                 \"cpu\" (the reference backend): build it with from_fsdp2 on CUDA parameters"
                    .into(),
            )),
            Kind::Closed => Err(closed()),
        }
    }
}
