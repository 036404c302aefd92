//! Verification kernels: a positional hash of device buffers, chunk by chunk in one launch, and a
//! scan for non-finite fp32 values. Backends hash what they offload before it leaves the device
//! and again after it came back, and their rollout weights after a transfer and before release.
//!
//! The hash of a chunk of `n` words `w[j]` is `fmix(Σ fmix((j << B) | w[j]) ⊕ n·φ)` (wrapping
//! sum, `B` the word width in bits, `fmix` MurmurHash3's 64-bit finaliser, a bijection): any
//! single changed word changes exactly one term, so every single-word corruption is detected;
//! words moved to another position change their terms too. It is not a defence against
//! deliberate tampering. [`chunk_hash_u32`] and [`chunk_hash_u16`] compute it on the host.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use crate::modules::{KernelSet, LoadedModule};
use crate::{CudaError, RankCtx};

/// CUDA C source of the verification kernels (no headers needed).
pub const VERIFY_SRC: &str = include_str!("../../../kernels/verify_hash.cu");

/// [`VERIFY_SRC`] as a kernel set.
pub const VERIFY_KERNELS: KernelSet =
    KernelSet::new("lifecycle_cuda verification kernels", VERIFY_SRC);

const PHI: u64 = 0x9E37_79B9_7F4A_7C15;

fn fmix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// The device hash of one chunk of 32-bit words (fp32 bits), on the host.
pub fn chunk_hash_u32(words: &[u32]) -> u64 {
    let acc = words.iter().enumerate().fold(0u64, |acc, (j, &w)| {
        acc.wrapping_add(fmix64(((j as u64) << 32) | u64::from(w)))
    });
    fmix64(acc ^ (words.len() as u64).wrapping_mul(PHI))
}

/// The device hash of one chunk of 16-bit words (bf16 bits), on the host.
pub fn chunk_hash_u16(words: &[u16]) -> u64 {
    let acc = words.iter().enumerate().fold(0u64, |acc, (j, &w)| {
        acc.wrapping_add(fmix64(((j as u64) << 16) | u64::from(w)))
    });
    fmix64(acc ^ (words.len() as u64).wrapping_mul(PHI))
}

/// The largest chunk [`ChunkTable::new`] makes by default: 1 Mi words (4 MB of fp32), so one
/// 15 GB buffer is about 3 600 chunks, one hash each.
pub const DEFAULT_CHUNK_WORDS: u64 = 1 << 20;

/// Segments of a flat buffer (tensors, each at a word offset) cut into chunks of at most
/// `max_chunk` words; each chunk remembers the segment it belongs to, so a mismatching chunk
/// names its tensor.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChunkTable {
    offsets: Vec<u64>,
    lens: Vec<u64>,
    owners: Vec<usize>,
    end: u64,
    /// Some chunk starts before the one listed ahead of it (segments given in no order, as
    /// lent tensors lie where their owner put them).
    unordered: bool,
}

impl ChunkTable {
    /// Chunks of `segments` (`(word offset, words)`, segment `i` owning its chunks); empty
    /// segments make no chunk. `max_chunk` is at least 1 and at most 2³² (the hash's position
    /// field).
    pub fn new(segments: impl IntoIterator<Item = (u64, u64)>, max_chunk: u64) -> Self {
        let max_chunk = max_chunk.clamp(1, 1 << 32);
        let mut t = ChunkTable::default();
        for (i, (offset, len)) in segments.into_iter().enumerate() {
            let mut at = 0;
            while at < len {
                let n = (len - at).min(max_chunk);
                t.unordered |= t.offsets.last().is_some_and(|&last| offset + at < last);
                t.offsets.push(offset + at);
                t.lens.push(n);
                t.owners.push(i);
                at += n;
            }
            t.end = t.end.max(offset + len);
        }
        t
    }

    /// Chunks.
    pub fn len(&self) -> usize {
        self.offsets.len()
    }

    /// Whether there is no chunk.
    pub fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }

    /// Chunk `i`: `(word offset, words)`.
    pub fn chunk(&self, i: usize) -> (u64, u64) {
        (self.offsets[i], self.lens[i])
    }

    /// The segment chunk `i` belongs to.
    pub fn owner(&self, i: usize) -> usize {
        self.owners[i]
    }

    /// One past the last word any chunk covers: the buffer must hold at least this many words.
    pub fn end(&self) -> u64 {
        self.end
    }

    /// The segment holding word `index`, if any chunk covers it (segments in any order).
    pub fn segment_of(&self, index: u64) -> Option<usize> {
        if self.unordered {
            return (0..self.len())
                .find(|&i| self.offsets[i] <= index && index < self.offsets[i] + self.lens[i])
                .map(|i| self.owners[i]);
        }
        let i = self
            .offsets
            .partition_point(|&o| o <= index)
            .checked_sub(1)?;
        (index < self.offsets[i] + self.lens[i]).then(|| self.owners[i])
    }

    /// The host hashes of `words` (a whole buffer) chunk by chunk, as the device computes them.
    pub fn host_hashes_u32(&self, words: &[u32]) -> Vec<u64> {
        (0..self.len())
            .map(|i| {
                let (o, n) = (self.offsets[i] as usize, self.lens[i] as usize);
                chunk_hash_u32(&words[o..o + n])
            })
            .collect()
    }
}

/// Width of the words a buffer is hashed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WordSize {
    /// 16-bit words (bf16).
    B16,
    /// 32-bit words (fp32).
    B32,
}

impl WordSize {
    /// Bytes per word.
    pub fn bytes(self) -> u64 {
        match self {
            WordSize::B16 => 2,
            WordSize::B32 => 4,
        }
    }
}

/// Chunk hashes being computed on a stream: the device table and output, kept alive until
/// [`PendingHashes::download`] brings the hashes back.
#[derive(Debug)]
pub struct PendingHashes {
    _offsets: CudaSlice<u64>,
    _lens: CudaSlice<u64>,
    out: CudaSlice<u64>,
    stream: Arc<CudaStream>,
    rank: usize,
}

impl PendingHashes {
    /// Waits for the stream the hashes were queued on and returns them, one per chunk.
    pub fn download(self) -> Result<Vec<u64>, CudaError> {
        self.stream
            .clone_dtoh(&self.out)
            .map_err(|e| CudaError::driver(self.rank, "downloading verification hashes", 0, e))
    }
}

/// The verification kernels loaded into one device's context.
#[derive(Debug, Clone)]
pub struct VerifyKernels {
    _module: Arc<LoadedModule>,
    hash32: CudaFunction,
    hash16: CudaFunction,
    nonfinite: CudaFunction,
    nonfinite16: CudaFunction,
    sm_count: u32,
}

impl VerifyKernels {
    /// Loads the verification kernels ([`VERIFY_KERNELS`]) into the context of `ctx`.
    pub(crate) fn load(ctx: &RankCtx) -> Result<Self, CudaError> {
        let m = ctx.module(&VERIFY_KERNELS)?;
        Ok(VerifyKernels {
            hash32: m.function("hash_chunks_b32")?,
            hash16: m.function("hash_chunks_b16")?,
            nonfinite: m.function("first_nonfinite_f32")?,
            nonfinite16: m.function("first_nonfinite_bf16")?,
            sm_count: m.sm_count(),
            _module: m,
        })
    }

    fn config(&self, chunks: usize) -> LaunchConfig {
        let blocks = (chunks as u64).clamp(1, u64::from(self.sm_count) * 8) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn upload(
        stream: &Arc<CudaStream>,
        table: &ChunkTable,
        rank: usize,
    ) -> Result<(CudaSlice<u64>, CudaSlice<u64>), CudaError> {
        let up = |v: &[u64]| {
            stream
                .clone_htod(v)
                .map_err(|e| CudaError::driver(rank, "uploading a chunk table", 0, e))
        };
        Ok((up(&table.offsets)?, up(&table.lens)?))
    }

    /// Queues the hashes of every chunk of `table` over the buffer at device address `base`
    /// (words of `word`) on `stream`; [`PendingHashes::download`] returns them.
    ///
    /// # Safety
    /// `base` must address at least `table.end()` readable words of `stream`'s device, alive and
    /// not written by other streams until the stream ran the kernel.
    pub unsafe fn hash(
        &self,
        stream: &Arc<CudaStream>,
        base: u64,
        word: WordSize,
        table: &ChunkTable,
        rank: usize,
    ) -> Result<PendingHashes, CudaError> {
        let (offs, lens) = Self::upload(stream, table, rank)?;
        let mut out = stream
            .alloc_zeros::<u64>(table.len().max(1))
            .map_err(|e| CudaError::driver(rank, "allocating verification hashes", 0, e))?;
        if !table.is_empty() {
            let f = match word {
                WordSize::B16 => &self.hash16,
                WordSize::B32 => &self.hash32,
            };
            let n = table.len() as u64;
            let mut b = stream.launch_builder(f);
            b.arg(&base).arg(&offs).arg(&lens).arg(&n).arg(&mut out);
            // SAFETY: the caller guarantees `base` covers the table's words; `offs`, `lens`
            // (n entries) and `out` (n hashes) are device buffers of this stream; the argument
            // list matches the kernel (pointer, 2 tables, count, output).
            unsafe { b.launch(self.config(table.len())) }
                .map_err(|e| CudaError::driver(rank, "launching the hash kernel", 0, e))?;
        }
        Ok(PendingHashes {
            _offsets: offs,
            _lens: lens,
            out,
            stream: stream.clone(),
            rank,
        })
    }

    /// The smallest word index covered by `table` whose fp32 value at `base` is NaN or
    /// infinite, or `None`. Waits for `stream`.
    ///
    /// # Safety
    /// As for [`VerifyKernels::hash`], with 32-bit words.
    pub unsafe fn first_nonfinite_f32(
        &self,
        stream: &Arc<CudaStream>,
        base: u64,
        table: &ChunkTable,
        rank: usize,
    ) -> Result<Option<u64>, CudaError> {
        // SAFETY: the caller's contract, with the kernel of 32-bit words.
        unsafe { self.first_nonfinite(&self.nonfinite, stream, base, table, rank) }
    }

    /// As [`VerifyKernels::first_nonfinite_f32`] over bf16 values.
    ///
    /// # Safety
    /// As for [`VerifyKernels::hash`], with 16-bit words.
    pub unsafe fn first_nonfinite_bf16(
        &self,
        stream: &Arc<CudaStream>,
        base: u64,
        table: &ChunkTable,
        rank: usize,
    ) -> Result<Option<u64>, CudaError> {
        // SAFETY: the caller's contract, with the kernel of 16-bit words.
        unsafe { self.first_nonfinite(&self.nonfinite16, stream, base, table, rank) }
    }

    /// # Safety
    /// As for [`VerifyKernels::hash`], with `f`'s word size.
    unsafe fn first_nonfinite(
        &self,
        f: &CudaFunction,
        stream: &Arc<CudaStream>,
        base: u64,
        table: &ChunkTable,
        rank: usize,
    ) -> Result<Option<u64>, CudaError> {
        if table.is_empty() {
            return Ok(None);
        }
        let (offs, lens) = Self::upload(stream, table, rank)?;
        let mut out = stream
            .clone_htod(&[u64::MAX])
            .map_err(|e| CudaError::driver(rank, "allocating the scan result", 0, e))?;
        let n = table.len() as u64;
        let mut b = stream.launch_builder(f);
        b.arg(&base).arg(&offs).arg(&lens).arg(&n).arg(&mut out);
        // SAFETY: as in `hash`: valid buffers of this stream, arguments match the kernel.
        unsafe { b.launch(self.config(table.len())) }
            .map_err(|e| CudaError::driver(rank, "launching the non-finite scan", 0, e))?;
        let found = stream
            .clone_dtoh(&out)
            .map_err(|e| CudaError::driver(rank, "downloading the scan result", 0, e))?;
        Ok(found.first().copied().filter(|&i| i != u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_of_finds_every_word_in_any_order() {
        // ascending, and in no order (lent tensors lie where their owner put them)
        for segments in [
            [(0u64, 10u64), (100, 10), (1000, 10)],
            [(1000, 10), (0, 10), (100, 10)],
            [(100, 10), (1000, 10), (0, 10)],
        ] {
            let t = ChunkTable::new(segments, 4);
            for (seg, &(start, len)) in segments.iter().enumerate() {
                for w in start..start + len {
                    assert_eq!(t.segment_of(w), Some(seg), "{segments:?}: word {w}");
                }
                assert_eq!(t.segment_of(start + len), None, "{segments:?}: past {seg}");
            }
        }
    }

    #[test]
    fn every_single_bit_flip_and_swap_changes_the_hash() {
        let v: Vec<u32> = (0..300u32)
            .map(|i| (i as f32 * 0.37 - 3.0).to_bits())
            .collect();
        let base = chunk_hash_u32(&v);
        for i in (0..v.len()).step_by(7) {
            for bit in 0..32 {
                let mut w = v.clone();
                w[i] ^= 1 << bit;
                assert_ne!(chunk_hash_u32(&w), base, "word {i} bit {bit}");
            }
        }
        let mut s = v.clone();
        s.swap(3, 200);
        assert_ne!(chunk_hash_u32(&s), base, "positions count");
        assert_ne!(chunk_hash_u32(&v[..299]), base, "length counts");
        let h: Vec<u16> = (0..100u16).collect();
        let mut g = h.clone();
        g[50] ^= 0x8000;
        assert_ne!(chunk_hash_u16(&h), chunk_hash_u16(&g));
        // zeros at different lengths differ too
        assert_ne!(chunk_hash_u16(&[0; 4]), chunk_hash_u16(&[0; 5]));
    }

    #[test]
    fn chunk_tables_cut_segments_and_name_their_owner() {
        let t = ChunkTable::new([(0, 10), (16, 0), (16, 25), (48, 3)], 8);
        assert_eq!(t.len(), 2 + 4 + 1);
        assert_eq!(t.chunk(0), (0, 8));
        assert_eq!(t.chunk(1), (8, 2));
        assert_eq!(t.chunk(2), (16, 8));
        assert_eq!(t.chunk(5), (40, 1));
        assert_eq!((t.owner(1), t.owner(2), t.owner(6)), (0, 2, 3));
        assert_eq!(t.end(), 51);
        assert_eq!(t.segment_of(9), Some(0));
        assert_eq!(t.segment_of(12), None, "a gap between segments");
        assert_eq!(t.segment_of(40), Some(2));
        assert_eq!(t.segment_of(50), Some(3));
        assert_eq!(t.segment_of(51), None);
        let words: Vec<u32> = (0..51).collect();
        let h = t.host_hashes_u32(&words);
        assert_eq!(h[3], chunk_hash_u32(&words[24..32]));
        assert!(ChunkTable::new([(0, 0)], 4).is_empty());
    }
}
