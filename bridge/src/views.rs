//! Views of the rollout weights handed to a caller: where each tensor is (address, shape, dtype,
//! device), the generation of the weights they show, and the leases that keep the weights from
//! being rewritten or freed while a view is referenced.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use lifecycle_layout::{HostRollout, RolloutEntry};

/// The element type of a view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViewDtype {
    /// bfloat16.
    Bf16,
    /// float8 e4m3 (`float8_e4m3fn`): the bytes of a block-scaled fp8 tensor.
    Float8E4m3,
    /// float32: an fp8 tensor's `weight_scale_inv`, one per 128 × 128 block.
    F32,
}

impl ViewDtype {
    /// Bits per element.
    pub fn bits(self) -> u8 {
        match self {
            ViewDtype::Bf16 => 16,
            ViewDtype::Float8E4m3 => 8,
            ViewDtype::F32 => 32,
        }
    }

    /// The name torch gives the dtype (`"bfloat16"`, `"float8_e4m3fn"`, `"float32"`).
    pub fn name(self) -> &'static str {
        match self {
            ViewDtype::Bf16 => "bfloat16",
            ViewDtype::Float8E4m3 => "float8_e4m3fn",
            ViewDtype::F32 => "float32",
        }
    }
}

/// Where a view's memory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// Memory of the CUDA device with this ordinal.
    Cuda(usize),
}

/// One rollout tensor of one rank, as a caller may read it: row-major and contiguous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorView {
    /// The rollout layout's name (`.weight_scale_inv` for an fp8 tensor's scales).
    pub name: String,
    /// Shape of the rank's slice.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: ViewDtype,
    /// Address of the first element.
    pub ptr: u64,
    /// Where it is.
    pub device: Device,
}

impl TensorView {
    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The name of an fp8 tensor's scales: `x.weight` → `x.weight_scale_inv` (vLLM's and the fp8
/// checkpoints' name).
pub fn scale_name(name: &str) -> String {
    match name.strip_suffix(".weight") {
        Some(stem) => format!("{stem}.weight_scale_inv"),
        None => format!("{name}_scale_inv"),
    }
}

/// The views of one rank's flat rollout buffer at `base` (bf16 slots) cut by its `entries`.
pub fn buffer_views(entries: &[RolloutEntry], base: u64, device: Device) -> Vec<TensorView> {
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
        let at = base + 2 * e.offset() as u64;
        match e.scale_offset() {
            None => out.push(TensorView {
                name: e.name().to_string(),
                shape: e.shape().to_vec(),
                dtype: ViewDtype::Bf16,
                ptr: at,
                device,
            }),
            Some(scales) => {
                let (r, c) = e.blocks();
                out.push(TensorView {
                    name: e.name().to_string(),
                    shape: e.shape().to_vec(),
                    dtype: ViewDtype::Float8E4m3,
                    ptr: at,
                    device,
                });
                out.push(TensorView {
                    name: scale_name(e.name()),
                    shape: vec![r, c],
                    dtype: ViewDtype::F32,
                    ptr: base + 2 * scales as u64,
                    device,
                });
            }
        }
    }
    out
}

/// The views of rank `rank` of a host rollout (each tensor's own allocation).
pub fn host_views(rollout: &HostRollout, rank: usize) -> Vec<TensorView> {
    let Some(r) = rollout.ranks.get(rank) else {
        return Vec::new();
    };
    let mut out = Vec::with_capacity(r.tensors.len());
    for t in &r.tensors {
        match &t.fp8 {
            None => out.push(TensorView {
                name: t.name.clone(),
                shape: t.shape.clone(),
                dtype: ViewDtype::Bf16,
                ptr: t.data.as_ptr() as u64,
                device: Device::Cpu,
            }),
            Some(q) => {
                let rows = t.shape.first().copied().unwrap_or(1).max(1);
                let cols = t.shape.iter().product::<usize>() / rows;
                out.push(TensorView {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    dtype: ViewDtype::Float8E4m3,
                    ptr: q.data().as_ptr() as u64,
                    device: Device::Cpu,
                });
                out.push(TensorView {
                    name: scale_name(&t.name),
                    shape: vec![
                        rows.div_ceil(lifecycle_layout::fp8::FP8_BLOCK),
                        cols.div_ceil(lifecycle_layout::fp8::FP8_BLOCK),
                    ],
                    dtype: ViewDtype::F32,
                    ptr: q.scale_inv().as_ptr() as u64,
                    device: Device::Cpu,
                });
            }
        }
    }
    out
}

/// Which handed-out views are still referenced, by name: a switch refuses to rewrite or free the
/// rollout weights while any is ([`BridgeError::InUse`](crate::BridgeError::InUse)).
///
/// ```
/// use std::sync::Arc;
/// use lifecycle_bridge::Leases;
/// let leases = Arc::new(Leases::default());
/// let a = Leases::take(&leases, "lm_head.weight");
/// let b = Leases::take(&leases, "lm_head.weight");
/// assert_eq!(leases.held(), vec!["lm_head.weight".to_string()]);
/// drop((a, b));
/// assert!(leases.held().is_empty());
/// ```
#[derive(Debug, Default)]
pub struct Leases {
    held: Mutex<BTreeMap<String, usize>>,
}

impl Leases {
    /// A lease on view `name`, released when dropped (from any thread).
    pub fn take(leases: &Arc<Leases>, name: &str) -> Lease {
        *leases
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(name.to_string())
            .or_default() += 1;
        Lease {
            leases: leases.clone(),
            name: name.to_string(),
        }
    }

    /// Names with a live lease, sorted, each once.
    pub fn held(&self) -> Vec<String> {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .cloned()
            .collect()
    }
}

/// A live reference to a handed-out view (see [`Leases`]).
#[derive(Debug)]
pub struct Lease {
    leases: Arc<Leases>,
    name: String,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut held = self
            .leases
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = held.get_mut(&self.name) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.name);
            }
        }
    }
}
