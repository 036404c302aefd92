//! The element type a decoder keeps its KV cache in.

use crate::fp8::{block_scale_inv, e4m3_from_f32, e4m3_to_f32};

/// The element type of a KV cache: what the decoders store K and V in, and what the memory
/// accounting (`lifecycle-plan`) counts.
///
/// ```
/// use lifecycle_layout::KvDtype;
/// assert_eq!(KvDtype::default(), KvDtype::Bf16);
/// assert_eq!((KvDtype::Bf16.bytes(), KvDtype::F32.bytes()), (2, 4));
/// assert_eq!("f32".parse::<KvDtype>(), Ok(KvDtype::F32));
/// assert_eq!(KvDtype::Bf16.to_string(), "bf16");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvDtype {
    /// bf16 K and V (rounded to nearest even when stored), as vLLM and SGLang keep them by
    /// default.
    #[default]
    Bf16,
    /// f32 K and V: the exact mode, in which the decoders match the transformers oracles.
    F32,
    /// fp8 e4m3 K and V with one f32 scale per position and kv head: `amax / 448` of the
    /// head's values (1 for an all-zero head), each value divided by it (IEEE division) and
    /// rounded to the nearest e4m3 value, ties to even: the weights' block formula over a
    /// head's `head_dim` values. Dynamic, so no calibration is needed; 4 bytes of scale per
    /// `head_dim` bytes. The CPU decoder keeps its cache so (the reference of an fp8 cache);
    /// the GPU decoder refuses it.
    Fp8,
}

impl KvDtype {
    /// Bytes per element (fp8's scales not counted: [`KvDtype::head_bytes`] counts them).
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::Bf16 => 2,
            KvDtype::F32 => 4,
            KvDtype::Fp8 => 1,
        }
    }

    /// Bytes of one kv head's K (or V) at one position: `head_dim` elements, and fp8's f32
    /// scale.
    ///
    /// ```
    /// use lifecycle_layout::KvDtype;
    /// assert_eq!(KvDtype::Bf16.head_bytes(128), 256);
    /// assert_eq!(KvDtype::Fp8.head_bytes(128), 132);
    /// ```
    pub fn head_bytes(self, head_dim: usize) -> usize {
        head_dim * self.bytes() + if self == KvDtype::Fp8 { 4 } else { 0 }
    }

    /// Appends to `out` the values of one kv head (`head`: its K or V at one position) as the
    /// cache gives them back: bf16 rounded to nearest even, f32 unchanged, fp8 quantised with
    /// the head's scale and dequantised (a non-finite value makes the head's bytes NaN, as the
    /// cast does).
    ///
    /// ```
    /// use lifecycle_layout::KvDtype;
    /// let head = [0.5f32, -3.0, 1.0e-3, 7.0];
    /// let mut out = Vec::new();
    /// KvDtype::Fp8.store_head(&head, &mut out);
    /// // the largest magnitude maps to 448 and back exactly; the others to within half an
    /// // e4m3 step of their binade (3 mantissa bits), or of the scale's subnormal step
    /// assert_eq!(out[3], 7.0);
    /// for (a, b) in head.iter().zip(&out) {
    ///     assert!((a - b).abs() <= (a.abs() / 16.0).max(7.0 / 448.0 / 512.0));
    /// }
    /// out.clear();
    /// KvDtype::Bf16.store_head(&head, &mut out);
    /// assert_eq!(out[0], 0.5);
    /// ```
    pub fn store_head(self, head: &[f32], out: &mut Vec<f32>) {
        match self {
            KvDtype::F32 => out.extend_from_slice(head),
            KvDtype::Bf16 => out.extend(head.iter().map(|&v| half::bf16::from_f32(v).to_f32())),
            KvDtype::Fp8 => {
                let amax = head.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let scale = block_scale_inv(amax);
                out.extend(
                    head.iter()
                        .map(|&v| e4m3_to_f32(e4m3_from_f32(v / scale)) * scale),
                );
            }
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvDtype::Bf16 => "bf16",
            KvDtype::F32 => "f32",
            KvDtype::Fp8 => "fp8",
        })
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;

    /// ```
    /// use lifecycle_layout::KvDtype;
    /// assert_eq!("bf16".parse(), Ok(KvDtype::Bf16));
    /// assert!("f16".parse::<KvDtype>().unwrap_err().contains("bf16, f32 or fp8"));
    /// ```
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "bf16" => Ok(KvDtype::Bf16),
            "f32" => Ok(KvDtype::F32),
            "fp8" => Ok(KvDtype::Fp8),
            other => Err(format!(
                "KV cache dtype `{other}`: expected bf16, f32 or fp8"
            )),
        }
    }
}
