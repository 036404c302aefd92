//! [`GpuModel`]: a rank pool, the FSDP backend and its lifecycle for one model, built in one
//! call: the glue of a model ([`lifecycle_decoder::ModelConfig`]), a backend
//! ([`lifecycle_fsdp::FsdpBackend`]) and the GPU decoder ([`lifecycle_decoder_gpu`]), which
//! import no backend themselves.

use std::path::Path;
use std::sync::Arc;

use lifecycle_core::{Lifecycle, LifecycleError};
use lifecycle_cuda::{CudaError, ThreadRankPool};
use lifecycle_decoder::{load_checkpoint, CheckpointError, DecodeError, ModelConfig};
use lifecycle_decoder_gpu::GpuDecodeError;
use lifecycle_fsdp::{FsdpBackend, FsdpError};
use lifecycle_layout::HostTensor;

/// Why building or switching a [`GpuModel`] failed. A missing driver, NCCL or GPU is a value
/// (`Cuda`), never a panic.
#[derive(Debug, thiserror::Error)]
pub enum GpuModelError {
    /// The decoder's checks failed (the topology of `world` and `tp`, among others).
    #[error(transparent)]
    Gpu(#[from] GpuDecodeError),
    /// A GPU, driver, NCCL or allocation failure.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// The FSDP backend failed while building the model.
    #[error(transparent)]
    Fsdp(#[from] FsdpError),
    /// A lifecycle operation failed (boxed: the lifecycle's error is large).
    #[error(transparent)]
    Lifecycle(Box<LifecycleError<FsdpError>>),
    /// The checkpoint could not be read.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The model config does not fit the rollout degree.
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

impl From<LifecycleError<FsdpError>> for GpuModelError {
    fn from(e: LifecycleError<FsdpError>) -> Self {
        GpuModelError::Lifecycle(Box::new(e))
    }
}

/// A model's FSDP training state on `T` GPUs (`W = T`) inside a [`Lifecycle`], with the rollout
/// layout [`ModelConfig::rollout_layout`] picks: enter rollout mode with
/// `lifecycle_mut().rollout()` and build a [`GpuDecoder`](lifecycle_decoder_gpu::GpuDecoder)
/// from the session.
///
/// Without an NVIDIA driver, NCCL or enough GPUs, construction returns
/// [`GpuModelError::Cuda`] (never a panic):
///
/// ```
/// use lifecycle_decoder::{random_tensors, ModelConfig};
/// use lifecycle_examples::gpu_model::GpuModel;
/// let config = ModelConfig::from_json_str(r#"{"model_type": "qwen2", "vocab_size": 32,
///   "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
///   "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0}"#)?;
/// match GpuModel::from_tensors(&config, random_tensors(&config, 1), 1) {
///     Ok(model) => assert_eq!(model.tp(), 1),
///     Err(e) => println!("no GPU here: {e}"),
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct GpuModel {
    config: ModelConfig,
    tp: usize,
    lifecycle: Lifecycle<FsdpBackend>,
}

impl std::fmt::Debug for GpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuModel")
            .field("config", &self.config)
            .field("tp", &self.tp)
            .finish()
    }
}

impl GpuModel {
    fn backend(config: &ModelConfig, tp: usize) -> Result<FsdpBackend, GpuModelError> {
        let layout = config.rollout_layout(tp).map_err(DecodeError::from)?;
        let pool = Arc::new(ThreadRankPool::new(tp)?);
        Ok(FsdpBackend::new(pool, layout))
    }

    /// The model from full host tensors (Hugging Face names, as [`load_checkpoint`] returns them)
    /// on GPUs `0..tp`.
    pub fn from_tensors(
        config: &ModelConfig,
        tensors: Vec<HostTensor>,
        tp: usize,
    ) -> Result<Self, GpuModelError> {
        let backend = Self::backend(config, tp)?;
        let state = backend.state_from_tensors(tensors)?;
        Ok(GpuModel {
            config: config.clone(),
            tp,
            lifecycle: Lifecycle::new(backend, state),
        })
    }

    /// The model from full host tensors on GPUs `0..world` (threads of this process) with rollout
    /// degree `tp`: `world = tp` is one tensor-parallel group ([`GpuModel::from_tensors`]),
    /// `tp = 1 < world` gives `world` data-parallel decoder replicas. Other pairs are
    /// [`GpuDecodeError::Topology`] (in [`GpuModelError::Gpu`]), before any GPU work.
    pub fn from_tensors_on(
        config: &ModelConfig,
        tensors: Vec<HostTensor>,
        world: usize,
        tp: usize,
    ) -> Result<Self, GpuModelError> {
        lifecycle_decoder_gpu::decode_topology(world, tp, world)?;
        let layout = config.rollout_layout(tp).map_err(DecodeError::from)?;
        let pool = Arc::new(ThreadRankPool::new(world)?);
        let backend = FsdpBackend::new(pool, layout);
        let state = backend.state_from_tensors(tensors)?;
        Ok(GpuModel {
            config: config.clone(),
            tp,
            lifecycle: Lifecycle::new(backend, state),
        })
    }

    /// The model of a Hugging Face checkpoint folder (`config.json` + `model.safetensors`).
    pub fn from_checkpoint(dir: &Path, tp: usize) -> Result<Self, GpuModelError> {
        let ckpt = load_checkpoint(dir)?;
        Self::from_tensors(&ckpt.config, ckpt.tensors, tp)
    }

    /// A model of `config`'s shapes with random weights made on the GPUs (no host data; see
    /// [`FsdpBackend::synthetic_state`]), uniform in `[-scale, scale)`.
    pub fn synthetic(
        config: &ModelConfig,
        tp: usize,
        seed: u64,
        scale: f32,
    ) -> Result<Self, GpuModelError> {
        let backend = Self::backend(config, tp)?;
        let state = backend.synthetic_state(&config.tensor_shapes(), seed, scale)?;
        Ok(GpuModel {
            config: config.clone(),
            tp,
            lifecycle: Lifecycle::new(backend, state),
        })
    }

    /// The model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// T (= W, except for data-parallel replicas built by [`GpuModel::from_tensors_on`]).
    pub fn tp(&self) -> usize {
        self.tp
    }

    /// The lifecycle: `rollout()` enters rollout mode, `train()` gives the training state.
    pub fn lifecycle_mut(&mut self) -> &mut Lifecycle<FsdpBackend> {
        &mut self.lifecycle
    }
}
