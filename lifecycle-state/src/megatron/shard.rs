//! Hugging Face full tensors → one rank's buffer of the Megatron layout.

use std::collections::HashMap;

use lifecycle_layout::hf;
use lifecycle_layout::megatron::{qkv_head_row, MegatronLayout, ParamKind, ParamSlot, QkvHead};

/// Full fp32 values by Hugging Face name.
pub(crate) type FullTensors<'a> = HashMap<&'a str, &'a [f32]>;

/// The fp32 buffers of every rank (rank order): every slot filled from the full tensors in
/// Megatron's layout (padding rows of the vocabulary zero); replicas are built once and cloned.
/// The names must have been checked.
pub(crate) fn rank_buffers(layout: &MegatronLayout, full: &FullTensors<'_>) -> Vec<Vec<f32>> {
    let mut built: HashMap<(usize, usize, usize, usize), Vec<f32>> = HashMap::new();
    (0..layout.world())
        .map(|rank| {
            let c = layout.coords(rank);
            let e = layout.expert_coords(rank);
            let key = (c.pp, c.tp, e.map_or(0, |e| e.etp), e.map_or(0, |e| e.ep));
            built
                .entry(key)
                .or_insert_with(|| rank_buffer(layout, rank, full))
                .clone()
        })
        .collect()
}

/// The fp32 buffer of `rank`: its stage's slots, the dense ones of its TP rank, the expert ones
/// of its expert-parallel and expert tensor-parallel ranks.
fn rank_buffer(layout: &MegatronLayout, rank: usize, full: &FullTensors<'_>) -> Vec<f32> {
    let stage = layout.coords(rank).pp;
    let mut buf = vec![0.0f32; layout.stage_len(stage)];
    for slot in layout.stage_slots(stage) {
        let dst = &mut buf[slot.offset..slot.offset + slot.numel()];
        fill_slot(layout, slot, rank, full, dst);
    }
    buf
}

fn get<'a>(full: &FullTensors<'a>, name: &str) -> &'a [f32] {
    full.get(name).copied().unwrap_or(&[])
}

fn fill_slot(
    layout: &MegatronLayout,
    slot: &ParamSlot,
    rank: usize,
    full: &FullTensors<'_>,
    dst: &mut [f32],
) {
    let tp = layout.coords(rank).tp;
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
        ParamKind::QNorm => dst.copy_from_slice(get(full, &layer(hf::Q_NORM))),
        ParamKind::KNorm => dst.copy_from_slice(get(full, &layer(hf::K_NORM))),
        ParamKind::Qkv | ParamKind::QkvBias => {
            let (names, cols) = if slot.kind == ParamKind::Qkv {
                ([hf::Q, hf::K, hf::V], h)
            } else {
                ([hf::Q_BIAS, hf::K_BIAS, hf::V_BIAS], 1)
            };
            let [q, k, v] = names.map(|n| get(full, &layer(n)));
            let head_len = m.head_dim * cols;
            // The full fused tensor (per query group: its q heads, its k head, its v head), of
            // which this rank holds the tp-th 1/TP chunk.
            let mut fused = vec![0.0f32; (m.heads + 2 * m.query_groups) * head_len];
            let mut put = |head: QkvHead, src: &[f32], i: usize| {
                let at = qkv_head_row(m, head) * head_len;
                fused[at..at + head_len].copy_from_slice(&src[i * head_len..(i + 1) * head_len]);
            };
            for h in 0..m.heads {
                put(QkvHead::Q(h), q, h);
            }
            for g in 0..m.query_groups {
                put(QkvHead::K(g), k, g);
                put(QkvHead::V(g), v, g);
            }
            let chunk = dst.len();
            dst.copy_from_slice(&fused[tp * chunk..(tp + 1) * chunk]);
        }
        ParamKind::SharedGate => dst.copy_from_slice(get(full, &layer(hf::SHARED_EXPERT_GATE))),
        ParamKind::Proj | ParamKind::Fc2 | ParamKind::SharedFc2 => {
            let (name, full_cols) = match slot.kind {
                ParamKind::Proj => (hf::O, m.q_rows()),
                ParamKind::Fc2 => (hf::DOWN, m.ffn),
                _ => (hf::SHARED_DOWN, m.moe.map_or(0, |moe| moe.shared_ffn)),
            };
            let src = get(full, &layer(name));
            let per = full_cols / n_tp;
            for r in 0..h {
                let s = r * full_cols + tp * per;
                dst[r * per..(r + 1) * per].copy_from_slice(&src[s..s + per]);
            }
        }
        ParamKind::Router => dst.copy_from_slice(get(full, &layer(hf::ROUTER))),
        ParamKind::ExpertFc1 | ParamKind::ExpertFc2 => {
            let (Some(ex), Some(c), Some(moe)) =
                (layout.expert_parallel(), layout.expert_coords(rank), m.moe)
            else {
                return;
            };
            let e = layout.global_expert(rank, slot.expert.unwrap_or_default());
            let l = slot.layer.unwrap_or_default();
            let per = moe.ffn / ex.etp();
            if slot.kind == ParamKind::ExpertFc1 {
                let rows = c.etp * per * h..(c.etp + 1) * per * h;
                let half = per * h;
                let gate = get(full, &hf::expert(l, e, hf::EXPERT_GATE));
                let up = get(full, &hf::expert(l, e, hf::EXPERT_UP));
                dst[..half].copy_from_slice(&gate[rows.clone()]);
                dst[half..].copy_from_slice(&up[rows]);
            } else {
                let down = get(full, &hf::expert(l, e, hf::EXPERT_DOWN));
                for r in 0..h {
                    let s = r * moe.ffn + c.etp * per;
                    dst[r * per..(r + 1) * per].copy_from_slice(&down[s..s + per]);
                }
            }
        }
        ParamKind::Fc1 | ParamKind::SharedFc1 => {
            let (gate, up, ffn) = if slot.kind == ParamKind::Fc1 {
                (hf::GATE, hf::UP, m.ffn)
            } else {
                let shared = m.moe.map_or(0, |moe| moe.shared_ffn);
                (hf::SHARED_GATE, hf::SHARED_UP, shared)
            };
            let per = ffn / n_tp;
            let half = per * h;
            let rows = tp * per * h..(tp + 1) * per * h;
            dst[..half].copy_from_slice(&get(full, &layer(gate))[rows.clone()]);
            dst[half..].copy_from_slice(&get(full, &layer(up))[rows]);
        }
    }
}
