//! Environment checks that run before anything touches cudarc (which panics when a library is
//! missing), and discovery of the NVRTC include path and GPU architecture.

use std::path::PathBuf;

use crate::CudaError;

/// What the environment offers, found by [`check_environment`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Environment {
    /// GPUs the driver reports.
    pub devices: usize,
    /// Whether NCCL loaded.
    pub nccl: bool,
    /// Whether NVRTC loaded.
    pub nvrtc: bool,
}

/// Whether the CUDA driver library can be loaded (never panics).
pub fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on candidate names and drops the handles; it
    // does not call into the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether the NCCL library can be loaded (never panics).
pub fn nccl_present() -> bool {
    // SAFETY: as for `driver_present`: a `dlopen` probe only.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// Whether the NVRTC library can be loaded (never panics).
pub fn nvrtc_present() -> bool {
    // SAFETY: as for `driver_present`: a `dlopen` probe only.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Checks that the driver, NCCL and NVRTC load and that at least `min_devices` GPUs are visible.
///
/// Call this before any other function of this crate: cudarc panics when a library is missing,
/// this returns a [`CudaError`] that says how to fix it.
///
/// ```
/// // On a machine without an NVIDIA driver this is an error, not a panic.
/// match lifecycle_cuda::check_environment(1) {
///     Ok(env) => assert!(env.devices >= 1),
///     Err(e) => assert!(!e.to_string().is_empty()),
/// }
/// ```
pub fn check_environment(min_devices: usize) -> Result<Environment, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    if !nccl_present() {
        return Err(CudaError::NoNccl);
    }
    if !nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    let devices = device_count()?;
    if devices == 0 {
        return Err(CudaError::NoDevice {
            detail: "device count is 0".into(),
        });
    }
    if devices < min_devices {
        return Err(CudaError::TooFewGpus {
            requested: min_devices,
            available: devices,
        });
    }
    Ok(Environment {
        devices,
        nccl: true,
        nvrtc: true,
    })
}

/// GPUs the driver reports; an error (not a panic) when the driver is missing.
pub fn device_count() -> Result<usize, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) => Ok(n.max(0) as usize),
        Err(e) => Err(CudaError::NoDevice {
            detail: format!("cuInit / cuDeviceGetCount returned {:?}", e.0),
        }),
    }
}

/// Folders searched for the CUDA headers, in order: `$LIFECYCLE_CUDA_INCLUDE`, `$CUDA_HOME/include`,
/// `$CUDA_PATH/include`, `/usr/local/cuda/include`, `/usr/local/cuda-13.0/include`, `/usr/include`.
pub fn include_candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(p) = std::env::var("LIFECYCLE_CUDA_INCLUDE") {
        out.push(PathBuf::from(p));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(p) = std::env::var(var) {
            out.push(PathBuf::from(p).join("include"));
        }
    }
    for p in [
        "/usr/local/cuda/include",
        "/usr/local/cuda-13.0/include",
        "/usr/include",
    ] {
        out.push(PathBuf::from(p));
    }
    out
}

/// The first candidate folder holding `cuda_bf16.h`, if any. The kernels of this crate need no
/// header (they round with integer arithmetic), so a missing include path is not an error for
/// them; kernels that include CUDA headers pass this to NVRTC.
pub fn find_cuda_include() -> Option<PathBuf> {
    include_candidates()
        .into_iter()
        .find(|p| p.join("cuda_bf16.h").is_file())
}

/// The architecture-specific NVRTC target of a device of compute capability (`major`, `minor`),
/// for kernels of instructions only it has (Hopper's `wgmma`): `sm_90a` on 9.0, else none
/// (`$LIFECYCLE_CUDA_ARCH` does not apply).
///
/// ```
/// use lifecycle_cuda::arch_specific_target;
/// assert_eq!(arch_specific_target(9, 0).as_deref(), Some("sm_90a"));
/// assert_eq!(arch_specific_target(8, 9), None);
/// ```
pub fn arch_specific_target(major: i32, minor: i32) -> Option<String> {
    ((major, minor) == (9, 0)).then(|| "sm_90a".to_string())
}

/// The NVRTC `--gpu-architecture` values to try for a device of compute capability
/// (`major`, `minor`): `$LIFECYCLE_CUDA_ARCH` if set, else `sm_XY`, then the virtual `compute_XY`
/// (PTX JIT-compiled by the driver), then `compute_90` and `compute_80` as last fallbacks.
pub fn arch_candidates(major: i32, minor: i32) -> Vec<String> {
    if let Ok(a) = std::env::var("LIFECYCLE_CUDA_ARCH") {
        return vec![a];
    }
    let mut v = vec![
        format!("sm_{major}{minor}"),
        format!("compute_{major}{minor}"),
    ];
    for f in ["compute_90", "compute_80"] {
        if !v.iter().any(|x| x == f) {
            v.push(f.to_string());
        }
    }
    v
}
