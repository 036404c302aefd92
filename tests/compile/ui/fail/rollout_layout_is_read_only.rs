// A rollout layout keeps what its constructor checked: its degree cannot be changed afterwards
// (a layout valid at T = 1 given T = 2 would split 1001 rows into two 500-row slices).
use lifecycle_layout::{Parallel, RolloutLayout, TensorSpec};

fn main() {
    let mut layout =
        RolloutLayout::new(1, vec![TensorSpec::new("lm_head.weight", [1001, 8], Parallel::Column)])
            .unwrap();
    layout.tp = 2;
}
