//! In-place training updates on the GPUs: seeded synthetic gradients and an Adam step applied to
//! the resident fp32 master, Adam m and v shards of an [`FsdpTrainState`].
//!
//! Nothing is reallocated: the device buffers are rewritten where they are, and the pinned host
//! buffers that offloading allocated at the first switch stay allocated for the next one.
//!
//! - [`FsdpBackend::fill_synthetic_grads`]: element `e` (flat index in the full tensor) of tensor
//!   `i` gets [`synthetic_grad_value`]`(seed, i, e, scale)`, a counter-based hash, so the
//!   gradients do not depend on W and the host computes the same values.
//! - [`FsdpBackend::adam_step`]: the formula and operation order of
//!   [`HostTrainState::adam_step`](lifecycle_state::HostTrainState::adam_step), compiled with
//!   `--fmad=false` (no contraction into fused multiply-adds), IEEE division and square root and
//!   no flush-to-zero, so the result is bit-identical to the host's; the bias corrections are
//!   computed on the host with the same expression.
//! - [`FsdpBackend::reset_optimizer`], [`FsdpBackend::fill_synthetic_master`],
//!   [`FsdpBackend::upload_master`]: put a state back to its starting point in place.
//!
//! Every call checks its inputs and that the buffers it touches are on the device before
//! anything moves; an offloaded or freed buffer is [`FsdpError::NotResident`].

use crate::state::RankTrain;
use lifecycle_layout::fsdp::ShardLayout;
use std::sync::Arc;

use lifecycle_cuda::cudarc::driver::CudaSlice;
use lifecycle_cuda::{CudaError, RankCtx, RankExecutor};
use lifecycle_layout::{AdamParams, HostTensor};

use crate::build::{fill_shards_uniform, shard_host_tensors};
use crate::update_kernels::{AdamConstants, UpdateKernels};
use crate::{FsdpBackend, FsdpError, FsdpTrainState};

/// The splitmix64 finaliser (the kernels' `mix64`).
fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The hash key of tensor `tensor`'s gradients under `seed`.
fn grad_key(seed: u64, tensor: usize) -> u64 {
    mix64(seed ^ mix64(tensor as u64))
}

/// The synthetic gradient of element `index` (flat, row-major, in the full tensor) of the
/// `tensor`-th training tensor under `seed`: uniform in `[-scale, scale)`. The host twin of
/// [`FsdpBackend::fill_synthetic_grads`], bit for bit.
///
/// ```
/// use lifecycle_fsdp::synthetic_grad_value;
/// let g = synthetic_grad_value(7, 3, 12_345, 0.5);
/// assert!((-0.5..0.5).contains(&g));
/// assert_eq!(g.to_bits(), synthetic_grad_value(7, 3, 12_345, 0.5).to_bits());
/// assert_ne!(g, synthetic_grad_value(8, 3, 12_345, 0.5));
/// ```
pub fn synthetic_grad_value(seed: u64, tensor: usize, index: u64, scale: f32) -> f32 {
    let x = mix64(grad_key(seed, tensor).wrapping_add(index));
    let u = (x >> 40) as f32 * (1.0 / 16_777_216.0);
    scale * (2.0 * u - 1.0)
}

/// Checks Adam hyper-parameters: `lr` finite and > 0, `beta1` and `beta2` in `[0, 1)`, `eps`
/// finite and > 0.
pub fn check_adam_params(p: &AdamParams) -> Result<(), FsdpError> {
    let checks: [(&'static str, f32, bool, &'static str); 4] = [
        ("lr", p.lr, p.lr.is_finite() && p.lr > 0.0, "finite and > 0"),
        ("beta1", p.beta1, (0.0..1.0).contains(&p.beta1), "in [0, 1)"),
        ("beta2", p.beta2, (0.0..1.0).contains(&p.beta2), "in [0, 1)"),
        (
            "eps",
            p.eps,
            p.eps.is_finite() && p.eps > 0.0,
            "finite and > 0",
        ),
    ];
    match checks.into_iter().find(|c| !c.2) {
        Some((name, value, _, expected)) => Err(FsdpError::AdamParam {
            name,
            value,
            expected,
        }),
        None => Ok(()),
    }
}

/// Which buffers an operation needs on the device.
#[derive(Debug, Clone, Copy)]
struct Needs {
    master: bool,
    moments: bool,
    grads: bool,
}

/// `Err(NotResident)` naming the first local rank and buffer that is not on the device.
fn require(
    state: &FsdpTrainState,
    locals: &[usize],
    operation: &'static str,
    needs: Needs,
) -> Result<(), FsdpError> {
    for (rt, &rank) in state.ranks.iter().zip(locals) {
        let offloaded = "offloaded to pinned host memory";
        let missing: [(bool, bool, &'static str, &'static str); 4] = [
            (
                needs.master,
                rt.master.is_offloaded(),
                "fp32 master weights",
                offloaded,
            ),
            (needs.moments, rt.m.is_offloaded(), "Adam m", offloaded),
            (needs.moments, rt.v.is_offloaded(), "Adam v", offloaded),
            (
                needs.grads,
                rt.grads.is_none(),
                "gradients",
                "freed (entering rollout mode frees them)",
            ),
        ];
        if let Some((_, _, buffer, found)) = missing.into_iter().find(|m| m.0 && m.1) {
            return Err(FsdpError::NotResident {
                operation,
                buffer,
                rank,
                found,
            });
        }
    }
    Ok(())
}

/// A device buffer the residency check has already found (an internal error otherwise).
fn on_device<'a>(
    buf: Option<&'a mut CudaSlice<f32>>,
    what: &str,
    rank: usize,
) -> Result<&'a mut CudaSlice<f32>, CudaError> {
    buf.ok_or_else(|| CudaError::Invalid(format!("rank {rank}: {what} is not on the device")))
}

/// The per-rank work of an in-place update: context, kernels, the rank's buffers, the layout.
type RankUpdate<'f> = dyn Fn(&RankCtx, &UpdateKernels, &mut RankTrain, &ShardLayout) -> Result<(), CudaError>
    + Sync
    + 'f;

impl FsdpBackend {
    /// The update kernels of every local rank (compiled and loaded at the first call).
    fn update_kernels(&self) -> Result<Arc<Vec<UpdateKernels>>, FsdpError> {
        let mut cache = self
            .update_kernels
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(k) = cache.as_ref() {
            return Ok(k.clone());
        }
        let loaded = Arc::new(self.pool().run(&UpdateKernels::load)?);
        *cache = Some(loaded.clone());
        Ok(loaded)
    }

    /// Checks that `state` belongs to this backend's pool.
    pub(crate) fn check_state(&self, state: &FsdpTrainState) -> Result<(), FsdpError> {
        let pool = self.pool();
        if state.world() != pool.world() || state.ranks.len() != pool.local_ranks().len() {
            return Err(FsdpError::WorldMismatch {
                state: state.world(),
                pool: pool.world(),
            });
        }
        Ok(())
    }

    /// With a frozen base whose rollout form a rollout holds: `what` would write its masters,
    /// refused naming the first frozen tensor (the refresh would not move it: the rollout would
    /// be stale).
    fn check_base_unwritten(&self, state: &FsdpTrainState, what: &str) -> Result<(), FsdpError> {
        if !self.options.frozen_base || !self.base_cast.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        let trained = &self.options.trained;
        match state
            .layout
            .tensors()
            .iter()
            .find(|(n, _)| !trained.moves(n))
        {
            None => Ok(()),
            Some((name, _)) => Err(FsdpError::Tensor {
                name: name.clone(),
                problem: format!(
                    "frozen (with_frozen_base) and cast into the resident rollout: {what} would \
                     write it; write only the trained tensors (adam_step moves them alone), or \
                     leave rollout mode first (exit)"
                ),
            }),
        }
    }

    /// Runs `f(ctx, kernels, rank buffers, shard layout)` on every local rank, then waits for
    /// the rank's streams, so later work on any stream (an offload copy) sees the result.
    fn run_update(&self, state: &mut FsdpTrainState, f: &RankUpdate<'_>) -> Result<(), FsdpError> {
        let kernels = self.update_kernels()?;
        let shards = &state.shards;
        let mut items: Vec<(&UpdateKernels, &mut RankTrain)> =
            kernels.iter().zip(state.ranks.iter_mut()).collect();
        self.pool().run_each(&mut items, &|ctx, (k, rt)| {
            // Earlier work (a reload on the copy stream) is complete before the kernels read.
            ctx.sync_all()?;
            let out = f(ctx, k, rt, shards);
            // Wait even after an error: nothing may still be running when the caller goes on.
            let synced = ctx.sync_all();
            out.and(synced)
        })?;
        Ok(())
    }

    /// Fills the gradient shards in place with seeded synthetic gradients: element `e` (flat
    /// index in the full tensor) of tensor `i` becomes
    /// [`synthetic_grad_value`]`(seed, i, e, scale)`, the same for every W. Padding is left as
    /// it is (zero). Needs the gradients on the device (train mode).
    pub fn fill_synthetic_grads(
        &self,
        state: &mut FsdpTrainState,
        seed: u64,
        scale: f32,
    ) -> Result<(), FsdpError> {
        if !scale.is_finite() {
            return Err(FsdpError::Config(format!(
                "the synthetic gradient scale must be finite, found {scale}"
            )));
        }
        self.check_state(state)?;
        let needs = Needs {
            master: false,
            moments: false,
            grads: true,
        };
        require(
            state,
            self.pool().local_ranks(),
            "filling synthetic gradients",
            needs,
        )?;
        self.run_update(state, &|ctx, k, rt, shards| {
            let g = on_device(rt.grads.as_mut(), "gradients", ctx.rank)?;
            if (g.len() as u64) < shards.rank_len {
                return Err(CudaError::Invalid(format!(
                    "rank {}: a gradient buffer of {} elements for a layout of {}",
                    ctx.rank,
                    g.len(),
                    shards.rank_len
                )));
            }
            let base = ctx.addr_mut(g);
            for (i, slot) in shards.slots.iter().enumerate() {
                let held = shards.held_rows(i, ctx.rank);
                let n = (held.len() * slot.cols) as u64;
                // SAFETY: the slot's held rows lie inside the gradient buffer (rank_len
                // elements, checked above), which `run_update` keeps alive and waits for.
                unsafe {
                    k.synthetic_grads(
                        &ctx.compute,
                        base + 4 * slot.offset,
                        n,
                        grad_key(seed, i),
                        (held.start * slot.cols) as u64,
                        scale,
                        ctx.rank,
                    )?;
                }
            }
            Ok(())
        })
    }

    /// One Adam step (with bias correction) of every fp32 master weight from the current
    /// gradients, in place on the device: the same formula, operation order and rounding as
    /// [`HostTrainState::adam_step`](lifecycle_state::HostTrainState::adam_step), bit for bit.
    /// Bumps [`FsdpTrainState::adam_steps`]. Needs master, m, v and the gradients on the device
    /// (train mode: after an exit reloaded them); an offloaded buffer is
    /// [`FsdpError::NotResident`], checked before anything changes.
    pub fn adam_step(
        &self,
        state: &mut FsdpTrainState,
        params: AdamParams,
    ) -> Result<(), FsdpError> {
        check_adam_params(&params)?;
        self.check_state(state)?;
        let needs = Needs {
            master: true,
            moments: true,
            grads: true,
        };
        require(state, self.pool().local_ranks(), "the Adam step", needs)?;
        let t = i32::try_from(state.adam_steps + 1).map_err(|_| {
            FsdpError::Config(format!(
                "{} Adam steps: the bias correction's exponent must fit in an i32",
                state.adam_steps
            ))
        })?;
        let c = AdamConstants::new(&params, t);
        // a frozen base is not trained: its masters and moments stay as they are
        let trained: Vec<bool> = state
            .layout
            .tensors()
            .iter()
            .map(|(name, _)| !self.options.frozen_base || self.options.trained.moves(name))
            .collect();
        self.run_update(state, &|ctx, k, rt, shards| {
            let rank = ctx.rank;
            let mut ptrs = [0u64; 4];
            for (p, (buf, what)) in ptrs.iter_mut().zip([
                (rt.master.device_mut(), "fp32 master weights"),
                (rt.m.device_mut(), "Adam m"),
                (rt.v.device_mut(), "Adam v"),
                (rt.grads.as_mut(), "gradients"),
            ]) {
                let b = on_device(buf, what, rank)?;
                if (b.len() as u64) < shards.rank_len {
                    return Err(CudaError::Invalid(format!(
                        "rank {rank}: {what} holds {} elements, the layout {}",
                        b.len(),
                        shards.rank_len
                    )));
                }
                *p = ctx.addr_mut(b);
            }
            for (i, slot) in shards.slots.iter().enumerate() {
                if !trained[i] {
                    continue;
                }
                let n = (shards.held_rows(i, rank).len() * slot.cols) as u64;
                let at = ptrs.map(|p| p + 4 * slot.offset);
                // SAFETY: the four buffers are distinct allocations of rank_len (checked above)
                // f32 each; the slot's held rows lie inside them; `run_update` keeps them alive
                // and waits for the kernels.
                unsafe { k.adam_step(&ctx.compute, at, n, &c, rank)? };
            }
            Ok(())
        })?;
        state.adam_steps += 1;
        Ok(())
    }

    /// Zeroes Adam m, v and the gradients in place and sets the step count to 0 (a fresh
    /// optimizer; the pinned host buffers stay allocated). Needs them on the device.
    pub fn reset_optimizer(&self, state: &mut FsdpTrainState) -> Result<(), FsdpError> {
        self.check_state(state)?;
        let needs = Needs {
            master: false,
            moments: true,
            grads: true,
        };
        require(
            state,
            self.pool().local_ranks(),
            "resetting the optimizer",
            needs,
        )?;
        self.run_update(state, &|ctx, _, rt, _| {
            for (buf, what) in [
                (rt.m.device_mut(), "Adam m"),
                (rt.v.device_mut(), "Adam v"),
                (rt.grads.as_mut(), "gradients"),
            ] {
                let b = on_device(buf, what, ctx.rank)?;
                ctx.compute
                    .memset_zeros(b)
                    .map_err(ctx.drv("zeroing optimizer state", 0))?;
            }
            Ok(())
        })?;
        state.adam_steps = 0;
        Ok(())
    }

    /// Rewrites the fp32 master weights in place with the values
    /// [`FsdpBackend::synthetic_state`]`(.., seed, scale)` gives them (m, v, grads and the step
    /// count unchanged). Needs the master weights on the device.
    pub fn fill_synthetic_master(
        &self,
        state: &mut FsdpTrainState,
        seed: u64,
        scale: f32,
    ) -> Result<(), FsdpError> {
        if !scale.is_finite() {
            return Err(FsdpError::Config(format!(
                "the synthetic weight scale must be finite, found {scale}"
            )));
        }
        self.check_state(state)?;
        let needs = Needs {
            master: true,
            moments: false,
            grads: false,
        };
        require(
            state,
            self.pool().local_ranks(),
            "rewriting the master weights",
            needs,
        )?;
        self.check_base_unwritten(state, "rewriting the master weights")?;
        self.run_update(state, &|ctx, _, rt, shards| {
            let master = on_device(rt.master.device_mut(), "fp32 master weights", ctx.rank)?;
            fill_shards_uniform(ctx, master, shards, seed, scale)
        })
    }

    /// Uploads full host tensors into the fp32 master shards in place (this process's ranks;
    /// padding zero). The tensors must be the state's, in its order, with its shapes; every
    /// check runs before anything moves. m, v, grads and the step count are unchanged.
    pub fn upload_master(
        &self,
        state: &mut FsdpTrainState,
        tensors: &[HostTensor],
    ) -> Result<(), FsdpError> {
        self.check_state(state)?;
        let expected = state.layout.tensors();
        if tensors.len() != expected.len() {
            return Err(FsdpError::Tensor {
                name: tensors
                    .get(expected.len())
                    .or(tensors.last())
                    .map_or_else(String::new, |t| t.name.clone()),
                problem: format!(
                    "{} tensors given, the training state has {}",
                    tensors.len(),
                    expected.len()
                ),
            });
        }
        for (t, (name, shape)) in tensors.iter().zip(expected) {
            if &t.name != name || &t.shape != shape {
                return Err(FsdpError::Tensor {
                    name: t.name.clone(),
                    problem: format!(
                        "expected `{name}` of shape {shape:?} at this position (the training \
                         state's order), found `{}` of shape {:?}",
                        t.name, t.shape
                    ),
                });
            }
        }
        let needs = Needs {
            master: true,
            moments: false,
            grads: false,
        };
        require(
            state,
            self.pool().local_ranks(),
            "uploading master weights",
            needs,
        )?;
        self.check_base_unwritten(state, "uploading master weights")?;
        let hosts = shard_host_tensors(self.pool().local_ranks(), &state.shards, tensors)?;
        let mut items: Vec<(&Vec<f32>, &mut RankTrain)> =
            hosts.iter().zip(state.ranks.iter_mut()).collect();
        self.pool().run_each(&mut items, &|ctx, (host, rt)| {
            ctx.sync_all()?;
            let master = on_device(rt.master.device_mut(), "fp32 master weights", ctx.rank)?;
            ctx.compute
                .memcpy_htod(host.as_slice(), master)
                .map_err(ctx.drv("uploading master shards", 0))?;
            ctx.sync_all()
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grad_twin_is_deterministic_in_range_and_independent_per_tensor() {
        let a: Vec<f32> = (0..4096)
            .map(|e| synthetic_grad_value(11, 2, e, 0.25))
            .collect();
        let b: Vec<f32> = (0..4096)
            .map(|e| synthetic_grad_value(11, 2, e, 0.25))
            .collect();
        assert_eq!(a, b);
        assert!(a.iter().all(|g| (-0.25..0.25).contains(g)));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.02, "{mean}");
        let other: Vec<f32> = (0..4096)
            .map(|e| synthetic_grad_value(11, 3, e, 0.25))
            .collect();
        assert!(a.iter().zip(&other).filter(|(x, y)| x == y).count() < 8);
    }

    #[test]
    fn adam_params_are_checked_by_name() {
        assert!(check_adam_params(&AdamParams::default()).is_ok());
        let bad = [
            (
                AdamParams {
                    lr: f32::NAN,
                    ..Default::default()
                },
                "lr",
            ),
            (
                AdamParams {
                    beta1: 1.0,
                    ..Default::default()
                },
                "beta1",
            ),
            (
                AdamParams {
                    beta2: -0.1,
                    ..Default::default()
                },
                "beta2",
            ),
            (
                AdamParams {
                    eps: 0.0,
                    ..Default::default()
                },
                "eps",
            ),
        ];
        for (p, name) in bad {
            match check_adam_params(&p) {
                Err(FsdpError::AdamParam { name: n, .. }) => assert_eq!(n, name),
                other => panic!("{name}: expected AdamParam, got {other:?}"),
            }
        }
        let msg = check_adam_params(&bad[1].0).unwrap_err().to_string();
        assert!(msg.contains("beta1") && msg.contains("[0, 1)"), "{msg}");
    }
}
