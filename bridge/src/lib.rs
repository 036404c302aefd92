//! The switch the Python package drives: tensors a trainer owns (host arrays on the CPU
//! reference backend, PyTorch FSDP2 shards on the GPU, lent by address) checked against a model
//! config by name, switched lazily into the rollout layout, and read back as [`TensorView`]s
//! under [`Leases`] that keep the rollout weights from being rewritten or freed while a caller
//! holds a view.
//!
//! Pure Rust (no Python here): `lifecycle-python` wraps it with pyo3 and DLPack.
//!
//! ```
//! use lifecycle_bridge::{HostSwitch, ModelBinding, SwitchSettings};
//! let config = r#"{"model_type": "qwen2", "vocab_size": 16, "hidden_size": 8,
//!   "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
//!   "intermediate_size": 16, "rope_theta": 10000.0, "tie_word_embeddings": true}"#;
//! let named = ModelBinding::expected(config)?;
//! let values: Vec<Vec<f32>> = named.iter().map(|(_, s)| vec![0.5; s.iter().product()]).collect();
//! let shards = vec![values.iter().map(|v| (v.as_ptr() as u64, v.len())).collect()];
//! let mut switch = HostSwitch::new(ModelBinding::new(config, named)?, SwitchSettings::new(1, 1))?;
//! // SAFETY: every shard points to that many f32 values, alive during the call
//! let first = unsafe { switch.enter(&shards, false)? };
//! assert!(first.switched);
//! // SAFETY: the same shards, still alive; nothing changed, so nothing is read or moved
//! let again = unsafe { switch.enter(&shards, false)? };
//! assert!(!again.switched);
//! let views = switch.views(0)?;
//! assert_eq!(views[0].name, "model.embed_tokens.weight");
//! # Ok::<(), lifecycle_bridge::BridgeError>(())
//! ```

pub mod error;
pub mod front;
pub mod gpu;
pub mod host;
pub mod model;
pub mod settings;
pub mod shards;
mod shared;
pub mod switch;
pub mod views;

pub use error::BridgeError;
pub use front::Switch;
pub use gpu::{Fsdp, GpuFront, GpuRankParts, GpuSwitch, Lending, Megatron};
pub use host::HostSwitch;
pub use model::ModelBinding;
pub use settings::SwitchSettings;
pub use shared::SharedWatch;
pub use switch::{Entered, SwitchStats};
pub use views::{Device, Lease, Leases, TensorView, ViewDtype};

/// Megatron-Core's parallel degrees, as [`Switch::megatron`] and
/// [`ModelBinding::megatron_parameters`] take them.
pub use lifecycle_layout::megatron::MegatronParallel;
