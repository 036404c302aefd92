//! The element type a decoder keeps its KV cache in.

/// The element type of a KV cache: what the decoders store K and V in, and what the memory
/// accounting (`lifecycle-plan`) counts.
///
/// ```
/// use lifecycle_decoder::KvDtype;
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
    /// fp8 e4m3 K and V (scales not counted): counted by the memory accounting for engines
    /// that keep them so; the project's decoders refuse it.
    Fp8,
}

impl KvDtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::Bf16 => 2,
            KvDtype::F32 => 4,
            KvDtype::Fp8 => 1,
        }
    }

    /// `v` as the cache holds it (bf16: rounded to nearest even; f32 and fp8 unchanged, fp8
    /// being refused by the decoders).
    pub fn stored(self, v: f32) -> f32 {
        match self {
            KvDtype::Bf16 => half::bf16::from_f32(v).to_f32(),
            KvDtype::F32 | KvDtype::Fp8 => v,
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
    /// use lifecycle_decoder::KvDtype;
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
