//! Block-scaled float8 e4m3: the rollout weight format of the published fp8 checkpoints
//! (DeepSeek-V3, Qwen3-FP8): `float8_e4m3fn` weights and one fp32 `weight_scale_inv` per
//! 128 × 128 block of the 2-D view, dequantised as `fp8 × scale_inv`.
//!
//! The block formula (checked bit for bit against PyTorch by `fixtures/fp8/make_fp8_fixtures.py`):
//! `amax = max |x|` over the block, `scale_inv = amax / 448` (f32), or 1 for an all-zero block,
//! and every element `e4m3(x / scale_inv)`, rounded to nearest even as PyTorch's
//! `.to(torch.float8_e4m3fn)` does. Edge blocks are partial. Non-finite values are refused: they
//! would poison their block's scale.
//!
//! ```
//! use lifecycle_layout::fp8::{quantize_blocks, e4m3_to_f32};
//! let x: Vec<f32> = (0..6).map(|i| i as f32 - 2.5).collect();
//! let q = quantize_blocks("w", &x, 2, 3)?;
//! assert_eq!(q.scale_inv(), &[2.5 / 448.0]);
//! // dequantised, each value is within e4m3's half-ulp (1/16 relative) of the input
//! for (b, v) in q.data().iter().zip(&x) {
//!     let d = e4m3_to_f32(*b) * q.scale_inv()[0];
//!     assert!((d - v).abs() <= v.abs() / 16.0 + 1e-6);
//! }
//! # Ok::<(), lifecycle_layout::LayoutError>(())
//! ```

mod activations;
mod codec;
mod dtype;
mod traffic;

pub use activations::{quantize_activation_groups, Fp8Compute, GroupQuantized};
pub use codec::{
    block_scale_inv, e4m3_from_f32, e4m3_to_f32, quantize_blocks, BlockQuantized, E4M3_MAX,
    FP8_BLOCK,
};
pub use dtype::{keeps_bf16, Fp8Keep, RolloutDtype};
pub use traffic::{check_fp8_plan, fp8_rank_traffic, Fp8Traffic};
