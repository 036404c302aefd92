//! The settings every switch backend holds ([`SwitchOptions`]) and the one place their builders
//! are written ([`Configure`]): the FSDP and Megatron backends, on the GPU and on the host, take
//! the same fields with the same defaults, and refuse by name a setting they cannot honour
//! ([`Configure::check_options`], called by their `plan` before anything moves).
//!
//! ```
//! use lifecycle_layout::fp8::RolloutDtype;
//! use lifecycle_layout::settings::{Configure, Honours, SwitchOptions};
//!
//! /// A backend that verifies but has no offload to overlap.
//! struct Demo(SwitchOptions);
//! impl Configure for Demo {
//!     const NAME: &'static str = "the demo backend";
//!     const HONOURS: Honours = Honours {
//!         verification: true,
//!         offload_overlap: false,
//!         frozen_base: false,
//!     };
//!     fn options(&self) -> &SwitchOptions { &self.0 }
//!     fn set_options(&mut self, options: SwitchOptions) { self.0 = options; }
//! }
//!
//! let demo = Demo(SwitchOptions::default())
//!     .with_rollout_dtype(RolloutDtype::Fp8)
//!     .with_verification(true);
//! assert_eq!((demo.rollout_dtype(), demo.verifies()), (RolloutDtype::Fp8, true));
//! assert!(demo.check_options().is_ok());
//! let e = demo.with_offload_overlap(true).check_options().unwrap_err().to_string();
//! assert!(e.contains("offload overlap") && e.contains("the demo backend"), "{e}");
//! ```

use crate::fp8::{Fp8Keep, RolloutDtype};
use crate::lora::Trained;

/// What a switch produces and how, the same for every backend. The default: bf16 rollout
/// weights, no matrices kept bf16 beyond the published exemptions, verification off, offload
/// not overlapped with the rollout, nothing frozen.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SwitchOptions {
    /// The rollout weights' dtype.
    pub dtype: RolloutDtype,
    /// Which matrices an fp8 rollout keeps bf16 beyond the published exemptions.
    pub fp8_keep: Fp8Keep,
    /// Verification mode: non-finite masters refused at plan, offloaded buffers and the
    /// rollout weights hashed and checked (the backends that honour it say how).
    pub verify: bool,
    /// Enter returns with its offload copies still running, each buffer freed in stream order
    /// behind its copy (the GPU backends).
    pub offload_overlap: bool,
    /// Every tensor but the trained ones ([`SwitchOptions::trained`]: the LoRA adapters and
    /// the whole tensors named beside them) is frozen: enter casts the base once, a refresh
    /// moves the trained tensors alone; a frozen tensor written since enter is refused by name
    /// (the host backend at refresh, the GPU backend at the write).
    pub frozen_base: bool,
    /// With a frozen base, what a refresh moves ([`Trained::moves`]): the LoRA adapters and
    /// the whole tensors trained beside them (PEFT's `modules_to_save`, trainable biases).
    /// `plan` refuses by name a whole tensor the model lacks or that is an adapter.
    pub trained: Trained,
}

/// Which of [`SwitchOptions`]' switches a backend honours (the dtype and the fp8 exemptions
/// every backend does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Honours {
    /// [`SwitchOptions::verify`].
    pub verification: bool,
    /// [`SwitchOptions::offload_overlap`].
    pub offload_overlap: bool,
    /// [`SwitchOptions::frozen_base`] and [`SwitchOptions::trained`].
    pub frozen_base: bool,
}

impl Honours {
    /// Every option (the FSDP backends, host and GPU).
    pub const ALL: Honours = Honours {
        verification: true,
        offload_overlap: true,
        frozen_base: true,
    };
    /// Offload overlap alone (the Megatron backends).
    pub const OVERLAP_ONLY: Honours = Honours {
        verification: false,
        offload_overlap: true,
        frozen_base: false,
    };
}

/// A setting a backend cannot honour, refused before anything moves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting} is on, but {backend} does not have it: {hint}")]
pub struct OptionError {
    /// The setting, as its builder names it.
    pub setting: &'static str,
    /// The backend ([`Configure::NAME`]).
    pub backend: &'static str,
    /// What to do instead.
    pub hint: &'static str,
}

/// A backend's [`SwitchOptions`] and their builders, written once for every backend (see the
/// [module](self) example).
pub trait Configure: Sized {
    /// The backend as errors name it.
    const NAME: &'static str;
    /// What the backend honours; [`Configure::check_options`] refuses the rest.
    const HONOURS: Honours;

    /// The options held.
    fn options(&self) -> &SwitchOptions;

    /// Replaces the options (a backend drops there what depended on the old ones: cached
    /// plans, hashes of resident weights).
    fn set_options(&mut self, options: SwitchOptions);

    /// Replaces every option at once.
    fn with_options(mut self, options: SwitchOptions) -> Self {
        self.set_options(options);
        self
    }

    /// Sets the rollout weights' dtype (bf16 by default). With [`RolloutDtype::Fp8`] the
    /// matrices ([`crate::fp8::keeps_bf16`] false) are quantised in enter and refresh to
    /// block-scaled e4m3, bit-identical on every backend; `plan` refuses non-finite masters and
    /// slices that cut a 128 × 128 block, naming the tensor, before anything moves.
    fn with_rollout_dtype(self, dtype: RolloutDtype) -> Self {
        let options = SwitchOptions {
            dtype,
            ..self.options().clone()
        };
        self.with_options(options)
    }

    /// Which matrices an fp8 rollout keeps bf16 beyond the published exemptions (none by
    /// default).
    fn with_fp8_keep(self, fp8_keep: Fp8Keep) -> Self {
        let options = SwitchOptions {
            fp8_keep,
            ..self.options().clone()
        };
        self.with_options(options)
    }

    /// Turns verification mode on or off: `plan` rejects NaN or infinite master weights (naming
    /// the tensor, rank and element); every offloaded buffer is hashed before it leaves and
    /// checked at reload; the rollout weights are hashed after every transfer and checked
    /// before release. A mismatch names the rank, tensor and buffer. Refused by the backends
    /// that do not have it ([`Honours::verification`]).
    fn with_verification(self, verify: bool) -> Self {
        let options = SwitchOptions {
            verify,
            ..self.options().clone()
        };
        self.with_options(options)
    }

    /// Overlaps the offload of an enter with the rollout (off by default): enter returns once
    /// the rollout weights are written, the device→host copies of what the memory policy moves
    /// still running on the copy stream, each buffer freed in stream order behind its copy;
    /// exit joins the copies before reloading. Verification and traced switches wait for their
    /// copies. Refused by the backends that do not have it ([`Honours::offload_overlap`]).
    fn with_offload_overlap(self, offload_overlap: bool) -> Self {
        let options = SwitchOptions {
            offload_overlap,
            ..self.options().clone()
        };
        self.with_options(options)
    }

    /// Freezes every tensor but the LoRA adapters and the whole tensors trained beside them
    /// ([`Configure::with_trained`]) (off by default): enter casts the frozen base once; a
    /// refresh (weights kept resident) moves and casts the trained tensors alone, after
    /// checking that no frozen tensor was written since enter (refused by name: its rollout
    /// form would be stale). Refused by the backends that do not have it
    /// ([`Honours::frozen_base`]).
    fn with_frozen_base(self, frozen_base: bool) -> Self {
        let options = SwitchOptions {
            frozen_base,
            ..self.options().clone()
        };
        self.with_options(options)
    }

    /// Names the whole tensors a frozen base trains beside the LoRA adapters (none by
    /// default): PEFT's `modules_to_save` weights, trainable biases. Every refresh moves them
    /// with the adapters, and writing them is not refused. `plan` refuses by name one the
    /// model lacks or that is an adapter; the backends without a frozen base refuse any.
    ///
    /// ```
    /// use lifecycle_layout::lora::Trained;
    /// use lifecycle_layout::settings::{Configure, Honours, SwitchOptions};
    /// # struct Demo(SwitchOptions);
    /// # impl Configure for Demo {
    /// #     const NAME: &'static str = "the demo backend";
    /// #     const HONOURS: Honours = Honours::OVERLAP_ONLY;
    /// #     fn options(&self) -> &SwitchOptions { &self.0 }
    /// #     fn set_options(&mut self, options: SwitchOptions) { self.0 = options; }
    /// # }
    /// let demo = Demo(SwitchOptions::default()).with_trained(Trained::new(["lm_head.weight"]));
    /// assert!(demo.trained().moves("lm_head.weight"));
    /// let e = demo.check_options().unwrap_err().to_string();
    /// assert!(e.contains("with_trained") && e.contains("the demo backend"), "{e}");
    /// ```
    fn with_trained(self, trained: Trained) -> Self {
        let options = SwitchOptions {
            trained,
            ..self.options().clone()
        };
        self.with_options(options)
    }

    /// With a frozen base, what a refresh moves: the adapters and the whole tensors trained
    /// beside them.
    fn trained(&self) -> &Trained {
        &self.options().trained
    }

    /// The rollout weights' dtype.
    fn rollout_dtype(&self) -> RolloutDtype {
        self.options().dtype
    }

    /// Which matrices an fp8 rollout keeps bf16 beyond the published exemptions.
    fn fp8_keep(&self) -> Fp8Keep {
        self.options().fp8_keep
    }

    /// Whether verification mode is on.
    fn verifies(&self) -> bool {
        self.options().verify
    }

    /// Whether enter overlaps its offload with the rollout.
    fn offload_overlap(&self) -> bool {
        self.options().offload_overlap
    }

    /// Refuses an option that is on where the backend does not honour it, by name.
    fn check_options(&self) -> Result<(), OptionError> {
        let o = self.options();
        if o.verify && !Self::HONOURS.verification {
            return Err(OptionError {
                setting: "verification (with_verification)",
                backend: Self::NAME,
                hint: "verify the switch on an FSDP backend (GPU or host), or turn it off",
            });
        }
        if o.offload_overlap && !Self::HONOURS.offload_overlap {
            return Err(OptionError {
                setting: "offload overlap (with_offload_overlap)",
                backend: Self::NAME,
                hint: "a host backend's offload is a copy in memory with nothing to overlap: \
                       turn it off",
            });
        }
        if o.frozen_base && !Self::HONOURS.frozen_base {
            return Err(OptionError {
                setting: "a frozen base (with_frozen_base)",
                backend: Self::NAME,
                hint: "switch LoRA models with a frozen base on the FSDP host backend for now, or \
                       turn it off (every tensor then switches at every update)",
            });
        }
        if !o.trained.is_empty() && !Self::HONOURS.frozen_base {
            return Err(OptionError {
                setting: "whole tensors trained beside the LoRA adapters (with_trained)",
                backend: Self::NAME,
                hint: "a frozen base's trained tensors need a backend with a frozen base (the \
                       FSDP backends); without a frozen base every tensor switches anyway: \
                       leave them out",
            });
        }
        Ok(())
    }
}
