//! Megatron-Core's parallel degrees of a training job: TP, PP, DP, the expert layers' EP and
//! ETP, and the vocabulary padding rule.

/// Megatron's default `--make-vocab-size-divisible-by`.
pub const MEGATRON_VOCAB_MULTIPLE: usize = 128;

/// The degrees of a Megatron-Core training layout and its vocabulary padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MegatronParallel {
    /// Tensor-parallel degree TP.
    pub tp: usize,
    /// Pipeline-parallel degree PP.
    pub pp: usize,
    /// Data-parallel degree DP.
    pub dp: usize,
    /// `--make-vocab-size-divisible-by`: the training vocabulary is padded to a multiple of this
    /// times TP.
    pub make_vocab_size_divisible_by: usize,
    /// Expert-parallel degree EP of the mixture-of-experts layers (1 for dense models).
    pub ep: usize,
    /// Expert tensor-parallel degree ETP (Megatron's default: TP).
    pub etp: usize,
}

impl MegatronParallel {
    /// TP × PP × DP with Megatron's defaults: padding [`MEGATRON_VOCAB_MULTIPLE`], EP 1,
    /// ETP = TP.
    pub fn new(tp: usize, pp: usize, dp: usize) -> Self {
        MegatronParallel {
            tp,
            pp,
            dp,
            make_vocab_size_divisible_by: MEGATRON_VOCAB_MULTIPLE,
            ep: 1,
            etp: tp,
        }
    }

    /// The same degrees with expert parallelism `ep` and expert tensor parallelism `etp`.
    ///
    /// ```
    /// use lifecycle_layout::megatron::MegatronParallel;
    /// let p = MegatronParallel::new(2, 1, 2).with_experts(4, 1);
    /// assert_eq!((p.world(), p.ep, p.etp), (4, 4, 1));
    /// ```
    pub fn with_experts(self, ep: usize, etp: usize) -> Self {
        MegatronParallel { ep, etp, ..self }
    }

    /// World size TP · PP · DP.
    pub fn world(&self) -> usize {
        self.tp * self.pp * self.dp
    }
}
