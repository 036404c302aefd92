//! The KV cache's layout: its size, a head's units and the dtypes the GPU decoder keeps.

use lifecycle_decoder::{DecodeError, KvDtype};

use crate::error::GpuDecodeError;

/// Elements of a KV cache of `slots` sequences × `cap` positions × `width` (kv heads ·
/// head dim) for k and v of `layers` layers.
pub(crate) fn kv_elements(layers: usize, slots: usize, cap: usize, width: usize) -> usize {
    2 * layers * slots * cap * width
}

/// The 2-byte units of one kv head's K (or V) at one position in a KV cache of `kv`, for heads
/// of `head_dim` values: f32 `2 · head_dim`, bf16 `head_dim`, fp8 `head_dim / 2 + 2` (the e4m3
/// bytes and the f32 scale of `KvDtype::store_head`); [`check_kv`] must hold.
pub(crate) fn kv_head_units(kv: KvDtype, head_dim: usize) -> usize {
    match kv {
        KvDtype::F32 => 2 * head_dim,
        KvDtype::Bf16 => head_dim,
        KvDtype::Fp8 => head_dim / 2 + 2,
    }
}

/// Whether the GPU decoder keeps a cache of `kv` for heads of `head_dim` values: f32 and bf16
/// always, fp8 for `head_dim` a multiple of 4 up to 256 (the records' scales 4-byte aligned, a
/// warp's registers holding a head).
pub(crate) fn check_kv(kv: KvDtype, head_dim: usize) -> Result<(), GpuDecodeError> {
    if kv == KvDtype::Fp8 && (!head_dim.is_multiple_of(4) || head_dim > 256) {
        return Err(DecodeError::Usage(format!(
            "KV cache dtype fp8: the GPU decoder keeps fp8 K and V for head_dim a multiple of 4 \
             up to 256; the model's is {head_dim}"
        ))
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_head_takes_the_bytes_the_memory_accounting_counts() {
        for kv in [KvDtype::F32, KvDtype::Bf16, KvDtype::Fp8] {
            for d in [8, 16, 64, 128, 256] {
                assert!(check_kv(kv, d).is_ok(), "{kv} at head_dim {d}");
                assert_eq!(2 * kv_head_units(kv, d), kv.head_bytes(d), "{kv} at {d}");
            }
        }
        // fp8 records need 4-byte aligned scales and a head a warp holds
        for d in [6, 10, 260, 512] {
            let e = check_kv(KvDtype::Fp8, d).unwrap_err().to_string();
            assert!(e.contains("fp8") && e.contains(&d.to_string()), "{e}");
            assert!(check_kv(KvDtype::Bf16, d).is_ok());
        }
    }
}
