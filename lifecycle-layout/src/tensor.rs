use crate::DType;
use half::{bf16, f16};

/// Data of a full (unsharded) tensor given to the host backend.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 values.
    BF16(Vec<bf16>),
    /// f16 values.
    F16(Vec<f16>),
    /// i64 values (not a valid weight type; rejected with a clear error).
    I64(Vec<i64>),
    /// i32 values (not a valid weight type; rejected with a clear error).
    I32(Vec<i32>),
}

impl TensorData {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            TensorData::F32(_) => DType::F32,
            TensorData::BF16(_) => DType::BF16,
            TensorData::F16(_) => DType::F16,
            TensorData::I64(_) => DType::I64,
            TensorData::I32(_) => DType::I32,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorData::F32(v) => v.len(),
            TensorData::BF16(v) => v.len(),
            TensorData::F16(v) => v.len(),
            TensorData::I64(v) => v.len(),
            TensorData::I32(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values widened to f32 (exact for bf16 and f16); `None` for integer types.
    pub fn to_f32(&self) -> Option<Vec<f32>> {
        match self {
            TensorData::F32(v) => Some(v.clone()),
            TensorData::BF16(v) => Some(v.iter().map(|x| x.to_f32()).collect()),
            TensorData::F16(v) => Some(v.iter().map(|x| x.to_f32()).collect()),
            TensorData::I64(_) | TensorData::I32(_) => None,
        }
    }
}

/// A named full tensor with its data: the input every executor builds a training state from
/// (for example `lifecycle_host::HostTrainState::from_tensors`).
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Unique name.
    pub name: String,
    /// Full shape.
    pub shape: Vec<usize>,
    /// Row-major data.
    pub data: TensorData,
}

impl HostTensor {
    /// An f32 tensor.
    pub fn f32(name: impl Into<String>, shape: impl Into<Vec<usize>>, data: Vec<f32>) -> Self {
        HostTensor {
            name: name.into(),
            shape: shape.into(),
            data: TensorData::F32(data),
        }
    }

    /// The same tensor with its floating-point values rounded to bf16 (nearest even), held as
    /// f32: values a bf16 parameter holds exactly, so a backend that keeps fp32 masters and one
    /// that keeps bf16 parameters see the same weights. Integer tensors are returned as they are.
    ///
    /// ```
    /// use lifecycle_layout::{HostTensor, TensorData};
    /// let t = HostTensor::f32("w", [2], vec![1.0, 1.0 + 2f32.powi(-10)]).bf16_rounded();
    /// assert_eq!(t.data, TensorData::F32(vec![1.0, 1.0]));
    /// ```
    pub fn bf16_rounded(self) -> HostTensor {
        match self.data.to_f32() {
            Some(v) => HostTensor::f32(
                self.name,
                self.shape,
                v.into_iter()
                    .map(|x| half::bf16::from_f32(x).to_f32())
                    .collect(),
            ),
            None => self,
        }
    }
}
