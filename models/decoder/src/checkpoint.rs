//! Hugging Face checkpoints: `config.json` + `model.safetensors` to and from [`HostTensor`]s.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use lifecycle_layout::{hf, HostTensor, TensorData};
use safetensors::tensor::{Dtype, SafeTensors, TensorView, View};

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

/// Loads `dir/config.json` and the weights: `dir/model.safetensors`, or the files a sharded
/// checkpoint's `dir/model.safetensors.index.json` lists (what `save_pretrained` writes above its
/// shard size, and how every large checkpoint is published).
///
/// Tensors the config does not need are ignored (a tied checkpoint that still carries
/// `lm_head.weight`, rotary buffers); a missing or mis-shaped one is an error naming it, and a
/// truncated or corrupt file is an error, never a panic. Mixture-of-experts weights are read in
/// either layout: the published per-expert tensors (`mlp.experts.{e}.gate_proj.weight`, …) or
/// the stacked ones transformers 5 holds in memory (`mlp.experts.gate_up_proj`
/// `[experts, 2·moe_ffn, hidden]` with gate rows first, `mlp.experts.down_proj`
/// `[experts, hidden, moe_ffn]`), which are cut into the per-expert tensors.
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
    let index = dir.join(INDEX);
    let paths = if index.exists() {
        shard_files(dir, &index)?
    } else {
        vec![dir.join("model.safetensors")]
    };
    let bytes = paths
        .iter()
        .map(|p| std::fs::read(p).map_err(io_err(p)))
        .collect::<Result<Vec<_>, _>>()?;
    let files = paths
        .iter()
        .zip(&bytes)
        .map(|(p, b)| parse(b, p))
        .collect::<Result<Vec<_>, _>>()?;
    let where_ = if paths.len() == 1 { &paths[0] } else { &index };
    let tensors = read_files(&config, &files, where_)?;
    Ok(Checkpoint { config, tensors })
}

/// The index file of a sharded checkpoint.
const INDEX: &str = "model.safetensors.index.json";

/// The distinct files of a sharded checkpoint's `weight_map`, in first-mention order.
fn shard_files(dir: &Path, index: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let bad = |message: String| CheckpointError::ConfigJson {
        path: index.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(index).map_err(io_err(index))?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let map = value
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| bad("no \"weight_map\" object naming each tensor's file".into()))?;
    let mut files: Vec<PathBuf> = Vec::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .filter(|f| !f.contains('/') && !f.contains('\\') && f.ends_with(".safetensors"))
            .ok_or_else(|| {
                bad(format!(
                    "tensor `{name}` maps to {file}, not a .safetensors file name in this folder"
                ))
            })?;
        let path = dir.join(file);
        if !files.contains(&path) {
            files.push(path);
        }
    }
    Ok(files)
}

fn parse<'b>(bytes: &'b [u8], path: &Path) -> Result<(PathBuf, SafeTensors<'b>), CheckpointError> {
    SafeTensors::deserialize(bytes)
        .map(|f| (path.to_path_buf(), f))
        .map_err(|e| CheckpointError::Safetensors {
            path: path.to_path_buf(),
            message: format!("{e:?}"),
        })
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
    read_files(config, &[parse(bytes, path)?], path)
}

/// A tensor found in one of the files.
fn find<'a>(files: &'a [(PathBuf, SafeTensors<'a>)], name: &str) -> Option<TensorView<'a>> {
    files.iter().find_map(|(_, f)| f.tensor(name).ok())
}

/// Refuses expert tensors the config has no place for: a checkpoint with more experts than
/// `num_experts`, or experts in a layer the config makes dense, belongs to another config.
fn check_experts(
    config: &ModelConfig,
    files: &[(PathBuf, SafeTensors<'_>)],
) -> Result<(), CheckpointError> {
    let spec = config.model_spec(128);
    for (path, file) in files {
        for name in file.names() {
            let Some((l, e)) = hf::parse_expert(name) else {
                continue;
            };
            let reason = match config.model.moe {
                None => Some("the config describes a dense model (model_type has no experts)".to_string()),
                Some(m) if e >= m.experts => Some(format!(
                    "expert {e} is past num_experts = {} (the checkpoint has more experts than the config)",
                    m.experts
                )),
                Some(_) if l >= config.model.layers => Some(format!(
                    "layer {l} is past num_hidden_layers = {}",
                    config.model.layers
                )),
                Some(_) if !spec.moe_layer(l) => Some(format!(
                    "the config makes layer {l} dense (mlp_only_layers / decoder_sparse_step)"
                )),
                Some(_) => None,
            };
            if let Some(reason) = reason {
                return Err(CheckpointError::UnexpectedTensor {
                    name: name.to_string(),
                    path: path.clone(),
                    reason,
                });
            }
        }
    }
    Ok(())
}

fn read_files(
    config: &ModelConfig,
    files: &[(PathBuf, SafeTensors<'_>)],
    path: &Path,
) -> Result<Vec<HostTensor>, CheckpointError> {
    check_experts(config, files)?;
    config
        .tensor_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let (data, found) = match find(files, &name) {
                Some(view) => (
                    decode(view.dtype(), view.data()),
                    (view.shape().to_vec(), view.dtype()),
                ),
                None => match stacked_expert(config, files, &name)? {
                    Some(hit) => hit,
                    None => {
                        return Err(CheckpointError::MissingTensor {
                            name: name.clone(),
                            path: path.to_path_buf(),
                            hint: if name == "lm_head.weight" {
                                ": the config says tie_word_embeddings is false"
                            } else if lifecycle_layout::hf::parse_expert(&name).is_some() {
                                ", or the stacked mlp.experts.gate_up_proj / down_proj of its layer"
                            } else {
                                ""
                            },
                        })
                    }
                },
            };
            if found.0 != shape {
                return Err(CheckpointError::Shape {
                    name,
                    expected: shape,
                    found: found.0,
                });
            }
            let data = data.ok_or_else(|| CheckpointError::DType {
                name: name.clone(),
                dtype: format!("{:?}", found.1),
            })?;
            Ok(HostTensor { name, shape, data })
        })
        .collect()
}

type Decoded = (Option<TensorData>, (Vec<usize>, Dtype));

/// Expert `e`'s `gate_proj` / `up_proj` / `down_proj` of layer `l` cut out of the stacked
/// tensors transformers 5 holds (`None` when the name is not an expert's or the layer has no
/// stacked tensor). The returned shape is the expert's, so a mis-shaped stack is reported
/// against the per-expert name.
fn stacked_expert(
    config: &ModelConfig,
    files: &[(PathBuf, SafeTensors<'_>)],
    name: &str,
) -> Result<Option<Decoded>, CheckpointError> {
    let (Some((l, e)), Some(moe)) = (lifecycle_layout::hf::parse_expert(name), config.model.moe)
    else {
        return Ok(None);
    };
    let (h, f) = (config.model.hidden, moe.ffn);
    let (stack, want, rows) = if name.ends_with(hf::EXPERT_DOWN) {
        ("down_proj", vec![moe.experts, h, f], 0..h)
    } else if name.ends_with(hf::EXPERT_GATE) {
        ("gate_up_proj", vec![moe.experts, 2 * f, h], 0..f)
    } else if name.ends_with(hf::EXPERT_UP) {
        ("gate_up_proj", vec![moe.experts, 2 * f, h], f..2 * f)
    } else {
        return Ok(None);
    };
    let stacked = format!("model.layers.{l}.mlp.experts.{stack}");
    let Some(view) = find(files, &stacked) else {
        return Ok(None);
    };
    if view.shape() != want.as_slice() {
        return Err(CheckpointError::Shape {
            name: stacked,
            expected: want,
            found: view.shape().to_vec(),
        });
    }
    let elem = view.dtype().size();
    let cols = want[2];
    let per_expert = want[1] * cols * elem;
    let start = e * per_expert + rows.start * cols * elem;
    let end = e * per_expert + rows.end * cols * elem;
    let shape = vec![rows.len(), cols];
    Ok(Some((
        view.data()
            .get(start..end)
            .and_then(|raw| decode(view.dtype(), raw)),
        (shape, view.dtype()),
    )))
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
