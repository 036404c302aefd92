//! Hugging Face full tensors → one (stage, TP rank) buffer of the Megatron layout.

use std::collections::HashMap;

use lifecycle_layout::hf;
use lifecycle_layout::megatron::{MegatronLayout, ParamKind, ParamSlot};

/// Full fp32 values by Hugging Face name.
pub(crate) type FullTensors<'a> = HashMap<&'a str, &'a [f32]>;

/// The fp32 buffer of (stage, TP rank `tp`): every slot filled from the full tensors in
/// Megatron's layout (padding rows of the vocabulary zero). The names must have been checked.
pub(crate) fn stage_buffer(
    layout: &MegatronLayout,
    stage: usize,
    tp: usize,
    full: &FullTensors<'_>,
) -> Vec<f32> {
    let mut buf = vec![0.0f32; layout.stage_len(stage)];
    for slot in layout.stage_slots(stage) {
        let dst = &mut buf[slot.offset..slot.offset + slot.numel()];
        fill_slot(layout, slot, tp, full, dst);
    }
    buf
}

fn get<'a>(full: &FullTensors<'a>, name: &str) -> &'a [f32] {
    full.get(name).copied().unwrap_or(&[])
}

fn fill_slot(
    layout: &MegatronLayout,
    slot: &ParamSlot,
    tp: usize,
    full: &FullTensors<'_>,
    dst: &mut [f32],
) {
    let m = layout.model();
    let h = m.hidden;
    let n_tp = layout.tp();
    let layer = |suffix: &str| hf::layer(slot.layer.unwrap_or_default(), suffix);
    match slot.kind {
        ParamKind::WordEmbedding | ParamKind::OutputLayer => {
            let name = if slot.kind == ParamKind::OutputLayer && !m.tied_embeddings {
                hf::LM_HEAD
            } else {
                hf::EMBED
            };
            let src = get(full, name);
            let per = layout.padded_vocab() / n_tp;
            for (i, row) in (tp * per..(tp + 1) * per).enumerate() {
                if row < m.vocab {
                    dst[i * h..(i + 1) * h].copy_from_slice(&src[row * h..(row + 1) * h]);
                }
            }
        }
        ParamKind::InputNorm => dst.copy_from_slice(get(full, &layer(hf::INPUT_NORM))),
        ParamKind::PreMlpNorm => dst.copy_from_slice(get(full, &layer(hf::POST_NORM))),
        ParamKind::FinalNorm => dst.copy_from_slice(get(full, hf::NORM)),
        ParamKind::Qkv | ParamKind::QkvBias => {
            let (names, cols) = if slot.kind == ParamKind::Qkv {
                ([hf::Q, hf::K, hf::V], h)
            } else {
                ([hf::Q_BIAS, hf::K_BIAS, hf::V_BIAS], 1)
            };
            let [q, k, v] = names.map(|n| get(full, &layer(n)));
            let head_len = m.head_dim * cols;
            let mut out: Vec<f32> = Vec::with_capacity(dst.len());
            let qpg = m.heads_per_group();
            // Per local query group: its q heads, its k head, its v head.
            let groups: Vec<(usize, std::ops::Range<usize>)> = if m.query_groups >= n_tp {
                let gl = m.query_groups / n_tp;
                (tp * gl..(tp + 1) * gl)
                    .map(|g| (g, g * qpg..(g + 1) * qpg))
                    .collect()
            } else {
                let hpr = m.heads / n_tp;
                vec![(tp / (n_tp / m.query_groups), tp * hpr..(tp + 1) * hpr)]
            };
            for (g, q_heads) in groups {
                for qh in q_heads {
                    out.extend_from_slice(&q[qh * head_len..(qh + 1) * head_len]);
                }
                out.extend_from_slice(&k[g * head_len..(g + 1) * head_len]);
                out.extend_from_slice(&v[g * head_len..(g + 1) * head_len]);
            }
            dst.copy_from_slice(&out);
        }
        ParamKind::Proj | ParamKind::Fc2 => {
            let (name, full_cols) = if slot.kind == ParamKind::Proj {
                (hf::O, m.q_rows())
            } else {
                (hf::DOWN, m.ffn)
            };
            let src = get(full, &layer(name));
            let per = full_cols / n_tp;
            for r in 0..h {
                let s = r * full_cols + tp * per;
                dst[r * per..(r + 1) * per].copy_from_slice(&src[s..s + per]);
            }
        }
        ParamKind::Fc1 => {
            let per = m.ffn / n_tp;
            let half = per * h;
            let rows = tp * per * h..(tp + 1) * per * h;
            dst[..half].copy_from_slice(&get(full, &layer(hf::GATE))[rows.clone()]);
            dst[half..].copy_from_slice(&get(full, &layer(hf::UP))[rows]);
        }
    }
}
