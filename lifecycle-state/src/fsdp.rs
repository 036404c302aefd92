use std::ops::Range;

use lifecycle_layout::{fsdp_rows, FsdpLayout};

use crate::checksum::checksum_f32;
use crate::error::HostError;
use lifecycle_layout::{AdamParams, HostTensor};

/// One of the training buffers an offload moves: the fp32 master weights or an Adam moment. Its
/// name (`"master"`, `"adam_m"`, `"adam_v"`) is how errors, fault injection and verification
/// name it, on every executor.
///
/// ```
/// use lifecycle_state::TrainBuffer;
/// assert_eq!(TrainBuffer::from_name("adam_m"), Some(TrainBuffer::AdamM));
/// assert_eq!(TrainBuffer::AdamV.name(), "adam_v");
/// assert_eq!(TrainBuffer::from_name("grad"), None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TrainBuffer {
    /// fp32 master weights.
    Master,
    /// Adam's first moment.
    AdamM,
    /// Adam's second moment.
    AdamV,
}

impl TrainBuffer {
    /// Every buffer, in the order errors report them.
    pub const ALL: [TrainBuffer; 3] = [TrainBuffer::Master, TrainBuffer::AdamM, TrainBuffer::AdamV];

    /// The buffer's name.
    pub fn name(self) -> &'static str {
        match self {
            TrainBuffer::Master => "master",
            TrainBuffer::AdamM => "adam_m",
            TrainBuffer::AdamV => "adam_v",
        }
    }

    /// Its position in [`TrainBuffer::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The buffer called `name`.
    pub fn from_name(name: &str) -> Option<TrainBuffer> {
        TrainBuffer::ALL.into_iter().find(|b| b.name() == name)
    }

    /// The buffer called `name`, or an error naming it and the names there are.
    pub fn parse(name: &str) -> Result<TrainBuffer, String> {
        TrainBuffer::from_name(name).ok_or_else(|| {
            format!("buffer must be \"master\", \"adam_m\" or \"adam_v\", found {name:?}")
        })
    }
}

/// Where a buffer of one rank lives.
#[derive(Debug, Clone)]
pub enum Residence {
    /// In the rank's device memory (counted by its meter).
    Device(Vec<f32>),
    /// Offloaded to host memory: a separate allocation; the device original was freed. The
    /// checksum is taken at offload in verification mode.
    Host(Box<[f32]>, Option<u64>),
}

/// An offloaded buffer whose checksum no longer matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mismatch {
    /// The checksum taken at offload.
    pub expected: u64,
    /// The checksum of the copy found.
    pub found: u64,
}

impl Residence {
    /// The buffer's values, wherever they live.
    pub fn values(&self) -> &[f32] {
        match self {
            Residence::Device(v) => v,
            Residence::Host(v, _) => v,
        }
    }

    /// The values while on the device.
    pub fn on_device(&self) -> Option<&[f32]> {
        match self {
            Residence::Device(v) => Some(v),
            Residence::Host(..) => None,
        }
    }

    fn bytes(&self) -> u64 {
        (self.values().len() * 4) as u64
    }

    /// Copies a device buffer to a fresh host allocation and frees the original (checksumming
    /// the copy when `verify`). Returns the bytes moved (0 if already offloaded).
    pub fn offload(&mut self, meter: &mut MemoryMeter, verify: bool) -> u64 {
        if let Residence::Device(v) = self {
            let host: Box<[f32]> = v.as_slice().into();
            let sum = verify.then(|| checksum_f32(&host));
            let bytes = self.bytes();
            *self = Residence::Host(host, sum);
            meter.free(bytes);
            bytes
        } else {
            0
        }
    }

    /// Copies a host buffer back to a fresh device allocation and frees the host copy. A buffer
    /// whose checksum no longer matches stays offloaded and is reported.
    pub fn reload(&mut self, meter: &mut MemoryMeter) -> Result<u64, Mismatch> {
        if let Residence::Host(h, sum) = self {
            if let Some(expected) = *sum {
                let found = checksum_f32(h);
                if found != expected {
                    return Err(Mismatch { expected, found });
                }
            }
            let bytes = (h.len() * 4) as u64;
            meter.alloc(bytes);
            *self = Residence::Device(h.to_vec());
            Ok(bytes)
        } else {
            Ok(0)
        }
    }

    /// Flips one bit of an offloaded buffer (fault injection); false if it is on the device or
    /// `index` is out of range.
    pub fn flip_offloaded_bit(&mut self, index: usize, bit: u32) -> bool {
        match self {
            Residence::Host(h, _) => match h.get_mut(index) {
                Some(v) => {
                    *v = f32::from_bits(v.to_bits() ^ (1 << (bit % 32)));
                    true
                }
                None => false,
            },
            Residence::Device(_) => false,
        }
    }
}

/// Device-memory accounting of one rank: what is allocated now and the peak.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryMeter {
    /// Bytes allocated now.
    pub current: u64,
    /// Largest `current` seen.
    pub peak: u64,
}

impl MemoryMeter {
    /// Counts `bytes` newly allocated.
    pub fn alloc(&mut self, bytes: u64) {
        self.current += bytes;
        self.peak = self.peak.max(self.current);
    }

    /// Counts `bytes` freed.
    pub fn free(&mut self, bytes: u64) {
        self.current = self.current.saturating_sub(bytes);
    }
}

/// One rank's FSDP shard of one tensor: fp32 master, grad, Adam m and v.
#[derive(Debug, Clone)]
pub struct Shard {
    /// Rows of the full tensor this shard holds.
    pub rows: Range<usize>,
    /// fp32 master weights.
    pub master: Residence,
    /// Freed while in rollout mode.
    pub grad: Option<Vec<f32>>,
    /// Adam first moment.
    pub adam_m: Residence,
    /// Adam second moment.
    pub adam_v: Residence,
}

/// Everything one rank holds.
#[derive(Debug, Clone)]
pub struct RankState {
    /// One shard per training tensor, in training order.
    pub shards: Vec<Shard>,
    /// The rank's "device" memory.
    pub meter: MemoryMeter,
}

/// Mutable access to one shard in train mode, given to update functions.
#[derive(Debug)]
pub struct ShardMut<'a> {
    /// The rank holding the shard.
    pub rank: usize,
    /// Index of the tensor in the training state.
    pub tensor: usize,
    /// Its name.
    pub name: &'a str,
    /// Its full shape.
    pub shape: &'a [usize],
    /// Rows of the full tensor this shard holds (dim 0).
    pub rows: Range<usize>,
    /// fp32 master weights of the shard, row-major.
    pub master: &'a mut [f32],
    /// Gradient of the shard.
    pub grad: &'a mut [f32],
    /// Adam first moment.
    pub adam_m: &'a mut [f32],
    /// Adam second moment.
    pub adam_v: &'a mut [f32],
}

/// The training state of `W` ranks: FSDP2 dim-0 shards of fp32 master weights, grads and Adam
/// moments, with real device-memory accounting per rank.
///
/// ```
/// use lifecycle_state::HostTrainState;
/// use lifecycle_layout::HostTensor;
/// let state = HostTrainState::from_tensors(2, vec![
///     HostTensor::f32("w", [3, 2], vec![1., 2., 3., 4., 5., 6.]),
/// ])?;
/// assert_eq!(state.master_shard(0, 0), Some(&[1., 2., 3., 4.][..]));
/// assert_eq!(state.master_shard(1, 0), Some(&[5., 6.][..]));
/// assert_eq!(state.full_master("w")?, vec![1., 2., 3., 4., 5., 6.]);
/// # Ok::<(), lifecycle_state::HostError>(())
/// ```
#[derive(Debug, Clone)]
pub struct HostTrainState {
    layout: FsdpLayout,
    ranks: Vec<RankState>,
    adam_steps: u64,
}

impl HostTrainState {
    /// Shards full tensors across `world` ranks. Checks every tensor (name, shape, dtype, element
    /// count) before building anything; floating-point inputs are widened to fp32 master weights;
    /// grads and Adam moments start at zero.
    pub fn from_tensors(world: usize, tensors: Vec<HostTensor>) -> Result<Self, HostError> {
        let layout = FsdpLayout::new(
            world,
            tensors.iter().map(|t| (t.name.clone(), t.shape.clone())),
        )?;
        for t in &tensors {
            if !t.data.dtype().is_float() {
                return Err(HostError::DType {
                    name: t.name.clone(),
                    found: t.data.dtype(),
                });
            }
            let expected: usize = t.shape.iter().product();
            if t.data.len() != expected {
                return Err(HostError::ElementCount {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    expected,
                    found: t.data.len(),
                });
            }
        }
        let mut ranks: Vec<RankState> = (0..world)
            .map(|_| RankState {
                shards: Vec::with_capacity(tensors.len()),
                meter: MemoryMeter::default(),
            })
            .collect();
        for t in &tensors {
            let full = t.data.to_f32().ok_or_else(|| HostError::DType {
                name: t.name.clone(),
                found: t.data.dtype(),
            })?;
            let cols: usize = t.shape.iter().skip(1).product();
            for (rank, state) in ranks.iter_mut().enumerate() {
                let rows = fsdp_rows(t.shape[0], world, rank);
                let master = full[rows.start * cols..rows.end * cols].to_vec();
                let n = master.len();
                state.meter.alloc(4 * 4 * n as u64);
                state.shards.push(Shard {
                    rows,
                    master: Residence::Device(master),
                    grad: Some(vec![0.0; n]),
                    adam_m: Residence::Device(vec![0.0; n]),
                    adam_v: Residence::Device(vec![0.0; n]),
                });
            }
        }
        Ok(HostTrainState {
            layout,
            ranks,
            adam_steps: 0,
        })
    }

    /// W.
    /// Every rank's shards and memory meter, in rank order: the executors' view of the state
    /// (the layout and the number of ranks cannot change through it).
    pub fn ranks(&self) -> &[RankState] {
        &self.ranks
    }

    /// Every rank's shards and memory meter, to offload, reload or rewrite in place.
    pub fn ranks_mut(&mut self) -> &mut [RankState] {
        &mut self.ranks
    }

    /// Every master weight on the device must be finite: the first NaN or infinity (by rank,
    /// tensor, element) is [`HostError::NonFinite`].
    pub fn check_finite(&self) -> Result<(), HostError> {
        for (rank, r) in self.ranks.iter().enumerate() {
            for (tensor, shard) in r.shards.iter().enumerate() {
                let Some(values) = shard.master.on_device() else {
                    continue;
                };
                if let Some((index, &value)) =
                    values.iter().enumerate().find(|(_, v)| !v.is_finite())
                {
                    return Err(HostError::NonFinite {
                        tensor: self.layout.tensors()[tensor].0.clone(),
                        rank,
                        index,
                        value,
                    });
                }
            }
        }
        Ok(())
    }

    /// Adam steps applied so far.
    pub fn adam_steps(&self) -> u64 {
        self.adam_steps
    }

    /// W.
    pub fn world(&self) -> usize {
        self.layout.world()
    }

    /// Names and full shapes, in training order.
    pub fn layout(&self) -> &FsdpLayout {
        &self.layout
    }

    /// Index of a tensor by name.
    pub fn tensor_index(&self, name: &str) -> Result<usize, HostError> {
        self.layout
            .tensors()
            .iter()
            .position(|(n, _)| n == name)
            .ok_or_else(|| HostError::UnknownTensor {
                name: name.to_string(),
            })
    }

    /// The fp32 master shard of `tensor` on `rank`; `None` while offloaded or out of range.
    pub fn master_shard(&self, rank: usize, tensor: usize) -> Option<&[f32]> {
        self.ranks.get(rank)?.shards.get(tensor)?.master.on_device()
    }

    /// The full fp32 master tensor, gathered from every rank's shard (offloaded or not).
    pub fn full_master(&self, name: &str) -> Result<Vec<f32>, HostError> {
        let i = self.tensor_index(name)?;
        Ok(self
            .ranks
            .iter()
            .flat_map(|r| r.shards[i].master.values().iter().copied())
            .collect())
    }

    /// Whether any master weights or optimizer state are offloaded.
    pub fn is_offloaded(&self) -> bool {
        self.ranks.iter().flat_map(|r| &r.shards).any(|s| {
            s.master.on_device().is_none()
                || s.adam_m.on_device().is_none()
                || s.adam_v.on_device().is_none()
        })
    }

    /// Device-memory accounting of `rank`.
    pub fn memory(&self, rank: usize) -> Option<MemoryMeter> {
        self.ranks.get(rank).map(|r| r.meter)
    }

    /// Calls `f` on every shard of every rank with mutable access to master, grad and Adam
    /// moments. Fails (changing nothing) if the state is offloaded.
    pub fn for_each_shard_mut(&mut self, mut f: impl FnMut(ShardMut<'_>)) -> Result<(), HostError> {
        if self.is_offloaded()
            || self
                .ranks
                .iter()
                .flat_map(|r| &r.shards)
                .any(|s| s.grad.is_none())
        {
            return Err(HostError::Offloaded {
                operation: "updating shards",
            });
        }
        for (rank, state) in self.ranks.iter_mut().enumerate() {
            for (tensor, shard) in state.shards.iter_mut().enumerate() {
                let (name, shape) = &self.layout.tensors()[tensor];
                let (
                    Residence::Device(master),
                    Some(grad),
                    Residence::Device(adam_m),
                    Residence::Device(adam_v),
                ) = (
                    &mut shard.master,
                    &mut shard.grad,
                    &mut shard.adam_m,
                    &mut shard.adam_v,
                )
                else {
                    continue; // unreachable: checked above
                };
                f(ShardMut {
                    rank,
                    tensor,
                    name,
                    shape,
                    rows: shard.rows.clone(),
                    master,
                    grad,
                    adam_m,
                    adam_v,
                });
            }
        }
        Ok(())
    }

    /// One Adam step (with bias correction) of every master weight from the current grads.
    pub fn adam_step(&mut self, p: AdamParams) -> Result<(), HostError> {
        let t = (self.adam_steps + 1) as i32;
        let (c1, c2) = (1.0 - p.beta1.powi(t), 1.0 - p.beta2.powi(t));
        self.for_each_shard_mut(|s| {
            for i in 0..s.master.len() {
                let g = s.grad[i];
                s.adam_m[i] = p.beta1 * s.adam_m[i] + (1.0 - p.beta1) * g;
                s.adam_v[i] = p.beta2 * s.adam_v[i] + (1.0 - p.beta2) * g * g;
                let m_hat = s.adam_m[i] / c1;
                let v_hat = s.adam_v[i] / c2;
                s.master[i] -= p.lr * m_hat / (v_hat.sqrt() + p.eps);
            }
        })?;
        self.adam_steps += 1;
        Ok(())
    }

    /// Flips bit `bit` of element `index` of an **offloaded** buffer (`"master"`, `"adam_m"` or
    /// `"adam_v"`) of `tensor` on `rank`: fault injection for testing verification mode. Returns
    /// whether a bit was flipped (false when the buffer is on the device or out of range); an
    /// unknown tensor or buffer name is an error.
    pub fn inject_offloaded_bit_flip(
        &mut self,
        rank: usize,
        tensor: &str,
        buffer: &str,
        index: usize,
        bit: u32,
    ) -> Result<bool, HostError> {
        let buffer = TrainBuffer::parse(buffer).map_err(HostError::Buffer)?;
        let i = self.tensor_index(tensor)?;
        let Some(shard) = self.ranks.get_mut(rank).and_then(|r| r.shards.get_mut(i)) else {
            return Ok(false);
        };
        Ok(match buffer {
            TrainBuffer::Master => shard.master.flip_offloaded_bit(index, bit),
            TrainBuffer::AdamM => shard.adam_m.flip_offloaded_bit(index, bit),
            TrainBuffer::AdamV => shard.adam_v.flip_offloaded_bit(index, bit),
        })
    }

    /// A bitwise snapshot of every buffer (master, grad, m, v) for round-trip tests.
    pub fn snapshot(&self) -> Vec<Vec<u32>> {
        self.ranks
            .iter()
            .flat_map(|r| &r.shards)
            .flat_map(|s| {
                let grad: &[f32] = s.grad.as_deref().unwrap_or(&[]);
                [
                    s.master.values(),
                    grad,
                    s.adam_m.values(),
                    s.adam_v.values(),
                ]
            })
            .map(|v| v.iter().map(|x| x.to_bits()).collect())
            .collect()
    }
}
