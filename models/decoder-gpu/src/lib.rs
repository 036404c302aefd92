//! The Qwen2 / Llama decoder of [`lifecycle_decoder`] on NVIDIA GPUs: [`GpuDecoder`] implements
//! the same [`Decoder`](lifecycle_decoder::Decoder) trait as the CPU reference and reads a GPU
//! backend's resident rollout weights ([`lifecycle_cuda::RolloutBuffer`]) in place, on every GPU of
//! the backend's rank pool: one tensor-parallel group (`W = T`, threads of one process or one
//! process per rank), or, at `T = 1` in one process, `W` data-parallel replicas that each decode
//! a share of the batch ([`decode_topology`]).
//!
//! - Matrix products in f32 accumulation; activations stay f32 and enter a product as two bf16
//!   rows (`hi`, `lo = x − hi`), so the weights are read once and the product sees ~16-bit
//!   activations. Up to 8 tokens (`GpuDecoder::set_bf16_mma_tokens`) a bf16 product runs the
//!   decoder's own `mma.sync` kernel (the W8A8 products' kernel, on bf16): each weight byte
//!   streamed once into registers, the hi and lo sums joined and the bias and residual added in
//!   the kernel, the sums split over the inputs in a fixed order; beyond, cuBLAS (`GemmEx`,
//!   bf16 × bf16 → f32) over the split rows.
//! - Small kernels compiled at run time with NVRTC: embedding gather, RMSNorm, RoPE, attention
//!   over an f32, bf16 or fp8 KV cache (`KvDtype`: f32 for `GpuDecoder` by default, the exact
//!   mode; bf16 for `GpuEngine`), SwiGLU, residual adds, argmax and the token pick
//!   (temperature, top-k, top-p, log-probabilities). A decode step's attention is split over the
//!   cache ([`SplitAttention`]: every K / V row read once for the query heads that share it, a
//!   long context spread over many blocks, the chunks joined in order); long prefills take a
//!   block per row and query head.
//! - NCCL all-reduce (sum) after the row-parallel o/down projections; NCCL all-gather of
//!   vocabulary-parallel logits.
//! - Decode steps at `T = 1` replayed from CUDA graphs (`GpuDecoder::set_step_graphs`, on by
//!   default): captured once per batch size and cache, bit-identical to the steps queued one
//!   launch at a time.
//! - [`GpuEngine`] is the decoder as a persistent rollout engine of a
//!   [`Lifecycle`](lifecycle_core::Lifecycle): handles and kernels built once, the KV cache
//!   allocated at wake and freed at sleep; optionally each group of samples of one prompt
//!   prefilled once (`EngineSettings::with_fork_prefill`).
//! - Both rollout layouts: the FSDP backends' unfused one and the Megatron backends' fused one
//!   (`qkv_proj`, `gate_up_proj`, padded vocabulary), detected from the buffer's tensor names
//!   ([`detect_layout`]).
//!
//! The crate imports no backend: it reads any backend that says where its rollouts live
//! ([`lifecycle_cuda::RolloutSource`]); the glue of a model, a backend and a lifecycle built in
//! one call is `lifecycle_examples::gpu_model::GpuModel`.
//!
//! This crate builds without CUDA (cudarc loads the libraries at run time); without a driver
//! every constructor returns a typed error. The GPU tests (`tests/gpu.rs`) are `#[ignore]`d.

#![warn(missing_docs)]

mod blas;
mod decoder;
mod download;
mod engine;
mod error;
mod fp8;
mod kernels;
mod prefill;
mod rollout;
mod shared;
mod topology;
mod vocab;
mod w8a8;

mod weights;

pub use decoder::{
    GpuDecoder, LoraMode, KV_PAGE_POSITIONS, MAX_CONTEXT, MOE_DEVICE_ROWS, ROOM_MARGIN_BYTES,
};
pub use engine::{EngineSettings, GpuEngine};
pub use error::GpuDecodeError;
pub use kernels::{SplitAttention, DECODER_KERNEL_SRC, SPLIT_HEADS};
pub use rollout::EngineSlots;
pub use shared::{SharedBase, SharedTensor, SHARED_ALIGN};
pub use topology::{decode_topology, replica_rows, DecodeTopology};
pub use weights::{detect_layout, LayoutKind};
