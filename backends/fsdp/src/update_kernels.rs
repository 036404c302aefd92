//! The update kernels (seeded synthetic gradients, the Adam step) and the per-backend cache of
//! their loaded copies.

use std::sync::{Arc, Mutex};

use lifecycle_cuda::cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use lifecycle_cuda::{CudaError, KernelSet, LoadedModule, RankCtx};
use lifecycle_layout::AdamParams;

/// CUDA C source of the update kernels (no headers). Compile with `--fmad=false`: the Adam step
/// must round every product and sum on its own, as the host does.
pub const UPDATE_KERNEL_SRC: &str = include_str!("../../../kernels/fsdp_update.cu");

/// [`UPDATE_KERNEL_SRC`] as a kernel set, with IEEE-exact arithmetic so it matches the CPU
/// executor's Adam bit for bit.
pub const UPDATE_KERNELS: KernelSet =
    KernelSet::new("lifecycle_fsdp update kernels", UPDATE_KERNEL_SRC).exact();

/// The update kernels loaded into one rank's context.
#[derive(Debug)]
pub(crate) struct UpdateKernels {
    _module: Arc<LoadedModule>,
    grads: CudaFunction,
    adam: CudaFunction,
    sm_count: u32,
}

/// The kernels of every local rank, compiled and loaded on first use (the backend's cache).
#[derive(Debug, Default)]
pub(crate) struct UpdateKernelCache(pub(crate) Mutex<Option<Arc<Vec<UpdateKernels>>>>);

impl UpdateKernels {
    /// Loads [`UPDATE_KERNELS`] into this rank's context (compiled once per process).
    pub(crate) fn load(ctx: &RankCtx) -> Result<Self, CudaError> {
        let m = ctx.module(&UPDATE_KERNELS)?;
        Ok(UpdateKernels {
            grads: m.function("synthetic_grads")?,
            adam: m.function("adam_step")?,
            sm_count: m.sm_count(),
            _module: m,
        })
    }

    pub(crate) fn grid(&self, n: u64) -> LaunchConfig {
        let blocks = n.div_ceil(256).clamp(1, self.sm_count as u64 * 16) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Writes `n` synthetic gradients at `dst`.
    ///
    /// # Safety
    /// `dst` must point to `n` writable f32 of the stream's device, alive until the kernel ran.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn synthetic_grads(
        &self,
        stream: &CudaStream,
        dst: u64,
        n: u64,
        key: u64,
        index_offset: u64,
        scale: f32,
        rank: usize,
    ) -> Result<(), CudaError> {
        if n == 0 {
            return Ok(());
        }
        let mut b = stream.launch_builder(&self.grads);
        b.arg(&dst).arg(&n).arg(&key).arg(&index_offset).arg(&scale);
        // SAFETY: the caller guarantees `dst` holds `n` f32; the arguments match the kernel's
        // parameters (pointer, 3 × u64, f32).
        unsafe { b.launch(self.grid(n)) }
            .map(|_| ())
            .map_err(|e| CudaError::driver(rank, "launching the synthetic gradient kernel", 0, e))
    }

    /// One Adam step on `n` elements at `w`, `m`, `v` from the gradients at `g`.
    ///
    /// # Safety
    /// `w`, `m`, `v` must point to `n` writable and `g` to `n` readable f32 of the stream's
    /// device, none overlapping another, alive until the kernel ran.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn adam_step(
        &self,
        stream: &CudaStream,
        [w, m, v, g]: [u64; 4],
        n: u64,
        c: &AdamConstants,
        rank: usize,
    ) -> Result<(), CudaError> {
        if n == 0 {
            return Ok(());
        }
        let mut b = stream.launch_builder(&self.adam);
        b.arg(&w)
            .arg(&m)
            .arg(&v)
            .arg(&g)
            .arg(&n)
            .arg(&c.beta1)
            .arg(&c.beta2)
            .arg(&c.one_minus_beta1)
            .arg(&c.one_minus_beta2)
            .arg(&c.c1)
            .arg(&c.c2)
            .arg(&c.lr)
            .arg(&c.eps);
        // SAFETY: the caller guarantees the four buffers; the arguments match the kernel's
        // parameters (4 pointers, u64, 8 × f32).
        unsafe { b.launch(self.grid(n)) }
            .map(|_| ())
            .map_err(|e| CudaError::driver(rank, "launching the Adam kernel", 0, e))
    }
}

/// The scalars of one Adam step, computed on the host exactly as
/// [`HostTrainState::adam_step`](lifecycle_state::HostTrainState::adam_step) computes them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdamConstants {
    pub(crate) beta1: f32,
    pub(crate) beta2: f32,
    pub(crate) one_minus_beta1: f32,
    pub(crate) one_minus_beta2: f32,
    pub(crate) c1: f32,
    pub(crate) c2: f32,
    pub(crate) lr: f32,
    pub(crate) eps: f32,
}

impl AdamConstants {
    pub(crate) fn new(p: &AdamParams, t: i32) -> Self {
        AdamConstants {
            beta1: p.beta1,
            beta2: p.beta2,
            one_minus_beta1: 1.0 - p.beta1,
            one_minus_beta2: 1.0 - p.beta2,
            c1: 1.0 - p.beta1.powi(t),
            c2: 1.0 - p.beta2.powi(t),
            lr: p.lr,
            eps: p.eps,
        }
    }
}
