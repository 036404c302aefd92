//! The trainer's shards as the bridge receives them: per rank, per tensor (in the binding's
//! order), an address and an element count, checked against the dim-0 chunks the training
//! layout gives each rank before anything is read.

use lifecycle_layout::{fsdp_rows, FsdpLayout};

use crate::error::BridgeError;

/// One rank's fp32 shard of one tensor: `(address, elements)`.
pub type Shard = (u64, usize);

/// Checks `shards[i][t]` (local rank `i`, global rank `ranks[i]`, tensor `t`) against `layout`:
/// one shard per tensor, each holding exactly the rows FSDP2 gives that rank
/// ([`fsdp_rows`]: dim-0 chunks of `⌈n / W⌉`, short or empty trailing ranks), a non-null
/// address when not empty.
///
/// ```
/// use lifecycle_bridge::shards::check_shards;
/// use lifecycle_layout::FsdpLayout;
/// let layout = FsdpLayout::new(3, [("w".to_string(), vec![4, 2])])?;
/// // rows 0..2, 2..4 and none: 4, 4 and 0 elements
/// check_shards(&layout, &[0, 1, 2], &[vec![(64, 4)], vec![(128, 4)], vec![(0, 0)]])?;
/// let err = check_shards(&layout, &[0, 1, 2], &[vec![(64, 4)], vec![(128, 2)], vec![(0, 0)]])
///     .unwrap_err();
/// assert!(err.to_string().contains("rows 2..4"), "{err}");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn check_shards(
    layout: &FsdpLayout,
    ranks: &[usize],
    shards: &[Vec<Shard>],
) -> Result<(), BridgeError> {
    if shards.len() != ranks.len() {
        return Err(BridgeError::Config(format!(
            "shards given for {} ranks, this switch drives {} (one list per local rank)",
            shards.len(),
            ranks.len()
        )));
    }
    let world = layout.world();
    for (list, &rank) in shards.iter().zip(ranks) {
        if list.len() != layout.tensors().len() {
            return Err(BridgeError::Config(format!(
                "rank {rank}: {} shards given, the model has {} tensors (one per tensor, in the \
                 order the switch was built with)",
                list.len(),
                layout.tensors().len()
            )));
        }
        for ((name, shape), &(ptr, elems)) in layout.tensors().iter().zip(list) {
            let rows = fsdp_rows(shape[0], world, rank);
            let cols: usize = shape[1..].iter().product();
            let want = rows.len() * cols;
            if elems != want {
                return Err(BridgeError::tensor(
                    name,
                    format!(
                        "rank {rank} of {world} holds rows {rows:?} of shape {shape:?} ({want} \
                         fp32 elements: FSDP2's dim-0 chunks), its shard has {elems}"
                    ),
                ));
            }
            if ptr == 0 && elems > 0 {
                return Err(BridgeError::tensor(
                    name,
                    format!("rank {rank}: the shard's address is null"),
                ));
            }
        }
    }
    Ok(())
}

/// Checks `params[i][t]` (local rank `i`, global rank `ranks[i]`, parameter `t`) against the
/// Megatron layout `layout`: one bf16 parameter per slot of the rank's stage
/// ([`MegatronLayout::stage_slots`](lifecycle_layout::megatron::MegatronLayout::stage_slots)),
/// each holding exactly the slot's elements, a non-null 2-byte aligned address.
///
/// ```
/// use lifecycle_bridge::shards::check_parameters;
/// use lifecycle_layout::megatron::MegatronLayout;
/// use lifecycle_layout::ModelSpec;
/// let layout = MegatronLayout::new(ModelSpec::tiny(), 1, 1, 1)?;
/// let mut params: Vec<(u64, usize)> =
///     layout.stage_slots(0).iter().map(|s| (0x1000, s.numel())).collect();
/// check_parameters(&layout, &[0], &[params.clone()])?;
/// params[1].1 += 1;
/// let err = check_parameters(&layout, &[0], &[params]).unwrap_err();
/// assert!(err.to_string().contains(&layout.stage_slots(0)[1].name), "{err}");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn check_parameters(
    layout: &lifecycle_layout::megatron::MegatronLayout,
    ranks: &[usize],
    params: &[Vec<Shard>],
) -> Result<(), BridgeError> {
    if params.len() != ranks.len() {
        return Err(BridgeError::Config(format!(
            "parameters given for {} ranks, this switch drives {} (one list per local rank)",
            params.len(),
            ranks.len()
        )));
    }
    for (list, &rank) in params.iter().zip(ranks) {
        let stage = layout.coords(rank).pp;
        let slots = layout.stage_slots(stage);
        if list.len() != slots.len() {
            return Err(BridgeError::Config(format!(
                "rank {rank}: {} parameters given, its pipeline stage {stage} has {} (one per \
                 parameter, in the order the switch's `parameters` lists them)",
                list.len(),
                slots.len()
            )));
        }
        for (slot, &(ptr, elems)) in slots.iter().zip(list) {
            if elems != slot.numel() {
                return Err(BridgeError::tensor(
                    &slot.name,
                    format!(
                        "rank {rank}'s part has shape {:?} ({} bf16 elements), the parameter \
                         given has {elems}",
                        slot.shape,
                        slot.numel()
                    ),
                ));
            }
            if (ptr == 0 && elems > 0) || ptr % 2 != 0 {
                return Err(BridgeError::tensor(
                    &slot.name,
                    format!("rank {rank}: address {ptr:#x} is null or not 2-byte aligned"),
                ));
            }
        }
    }
    Ok(())
}
