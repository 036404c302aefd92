//! Hugging Face checkpoints: `config.json` + `model.safetensors` to and from [`HostTensor`]s.

use std::borrow::Cow;
use std::path::Path;

use half::{bf16, f16};
use lifecycle_layout::{HostTensor, TensorData};
use safetensors::tensor::{Dtype, SafeTensors, View};

use crate::config::{ConfigStyle, ModelConfig};
use crate::error::CheckpointError;

/// A loaded checkpoint: its config and every parameter as a full tensor, in
/// [`ModelConfig::tensor_shapes`] order (ready for `HostTrainState::from_tensors`).
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The model config.
    pub config: ModelConfig,
    /// Every parameter the config implies (no `lm_head.weight` when the embeddings are tied).
    pub tensors: Vec<HostTensor>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Loads `dir/config.json` and `dir/model.safetensors`.
///
/// Tensors the config does not need are ignored (a tied checkpoint that still carries
/// `lm_head.weight`, rotary buffers); a missing or mis-shaped one is an error naming it, and a
/// truncated or corrupt file is an error, never a panic.
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("lc-doc-load-{}", std::process::id()));
/// use lifecycle_decoder::{load_checkpoint, random_tensors, save_checkpoint, ConfigStyle, ModelConfig};
/// let config = ModelConfig::from_json_str(r#"{"model_type": "llama", "vocab_size": 16,
///   "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
///   "num_attention_heads": 2, "rope_theta": 10000.0}"#)?;
/// save_checkpoint(&dir, &config, &random_tensors(&config, 7), ConfigStyle::V4)?;
/// let ckpt = load_checkpoint(&dir)?;
/// assert_eq!(ckpt.config, ModelConfig { dtype: Some("float32".into()), ..config });
/// assert_eq!(ckpt.tensors.len(), 1 + 9 + 2); // embed, 9 per layer (no biases), norm, head
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn load_checkpoint(dir: &Path) -> Result<Checkpoint, CheckpointError> {
    let config = ModelConfig::from_file(&dir.join("config.json"))?;
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).map_err(io_err(&path))?;
    let tensors = read_tensors(&config, &bytes, &path)?;
    Ok(Checkpoint { config, tensors })
}

/// Reads the tensors `config` needs from the bytes of a safetensors file (`path` names it in
/// errors).
///
/// ```
/// use lifecycle_decoder::{read_tensors, ModelConfig};
/// let config = ModelConfig::from_json_str(r#"{"model_type": "qwen2", "vocab_size": 8,
///   "hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1,
///   "num_attention_heads": 2, "rope_theta": 10000.0}"#)?;
/// // eight bytes announcing a 1000-byte header that is not there
/// let err = read_tensors(&config, &1000u64.to_le_bytes(), "m.safetensors".as_ref()).unwrap_err();
/// assert!(err.to_string().starts_with("m.safetensors: not a valid safetensors file"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn read_tensors(
    config: &ModelConfig,
    bytes: &[u8],
    path: &Path,
) -> Result<Vec<HostTensor>, CheckpointError> {
    let file = SafeTensors::deserialize(bytes).map_err(|e| CheckpointError::Safetensors {
        path: path.to_path_buf(),
        message: format!("{e:?}"),
    })?;
    config
        .tensor_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let view = file
                .tensor(&name)
                .map_err(|_| CheckpointError::MissingTensor {
                    name: name.clone(),
                    path: path.to_path_buf(),
                    hint: if name == "lm_head.weight" {
                        ": the config says tie_word_embeddings is false"
                    } else {
                        ""
                    },
                })?;
            if view.shape() != shape.as_slice() {
                return Err(CheckpointError::Shape {
                    name,
                    expected: shape,
                    found: view.shape().to_vec(),
                });
            }
            let data = decode(view.dtype(), view.data()).ok_or_else(|| CheckpointError::DType {
                name: name.clone(),
                dtype: format!("{:?}", view.dtype()),
            })?;
            Ok(HostTensor { name, shape, data })
        })
        .collect()
}

fn decode(dtype: Dtype, raw: &[u8]) -> Option<TensorData> {
    Some(match dtype {
        Dtype::F32 => TensorData::F32(
            raw.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ),
        Dtype::BF16 => TensorData::BF16(
            raw.chunks_exact(2)
                .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])))
                .collect(),
        ),
        Dtype::F16 => TensorData::F16(
            raw.chunks_exact(2)
                .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])))
                .collect(),
        ),
        _ => return None,
    })
}

/// One tensor prepared for the safetensors writer.
struct Encoded {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &Encoded {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn encode(t: &HostTensor) -> Result<Encoded, CheckpointError> {
    let numel: usize = t.shape.iter().product();
    if numel != t.data.len() {
        return Err(CheckpointError::Export {
            name: t.name.clone(),
            problem: format!(
                "{} elements but shape {:?} needs {numel}",
                t.data.len(),
                t.shape
            ),
        });
    }
    let (dtype, bytes): (Dtype, Vec<u8>) = match &t.data {
        TensorData::F32(v) => (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        TensorData::BF16(v) => (
            Dtype::BF16,
            v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        ),
        TensorData::F16(v) => (
            Dtype::F16,
            v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        ),
        TensorData::I64(v) => (Dtype::I64, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        TensorData::I32(v) => (Dtype::I32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
    };
    Ok(Encoded {
        dtype,
        shape: t.shape.clone(),
        bytes,
    })
}

/// Writes `dir/config.json` (in `style`) and `dir/model.safetensors` holding `tensors`, creating
/// `dir`. The tensors are written as given (the exporter does not check them against the config,
/// so tests can write broken checkpoints).
pub fn save_checkpoint(
    dir: &Path,
    config: &ModelConfig,
    tensors: &[HostTensor],
    style: ConfigStyle,
) -> Result<(), CheckpointError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, config.to_json(style)).map_err(io_err(&config_path))?;
    let encoded: Vec<(String, Encoded)> = tensors
        .iter()
        .map(|t| Ok((t.name.clone(), encode(t)?)))
        .collect::<Result<_, CheckpointError>>()?;
    let path = dir.join("model.safetensors");
    let bytes = safetensors::serialize(encoded.iter().map(|(n, e)| (n.as_str(), e)), &None)
        .map_err(|e| CheckpointError::Safetensors {
            path: path.clone(),
            message: format!("{e:?}"),
        })?;
    std::fs::write(&path, bytes).map_err(io_err(&path))
}

/// Random f32 weights for `config` (norms near one, small projections), deterministic in `seed`:
/// for tests and synthetic runs.
pub fn random_tensors(config: &ModelConfig, seed: u64) -> Vec<HostTensor> {
    let mut rng = crate::sampling::SplitMix64::new(seed);
    config
        .tensor_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let data = if shape.len() == 1 && name.ends_with("norm.weight") {
                (0..n).map(|_| 1.0 + rng.symmetric(0.1)).collect()
            } else if shape.len() == 1 {
                (0..n).map(|_| rng.symmetric(0.05)).collect()
            } else {
                let scale = if name.contains("embed") {
                    1.0
                } else {
                    1.7 / (shape[1] as f32).sqrt()
                };
                (0..n).map(|_| rng.symmetric(scale)).collect()
            };
            HostTensor::f32(name, shape, data)
        })
        .collect()
}
