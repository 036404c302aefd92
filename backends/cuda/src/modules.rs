//! The one place kernels are compiled and loaded: NVRTC compiles each [`KernelSet`] once per GPU
//! architecture in the process, and each rank context loads each set once
//! ([`RankCtx::module`](crate::RankCtx::module)). Every kernel of the workspace (casts, copies,
//! verification hashes, Adam, the decoder's) goes through here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use crate::env::{arch_candidates, arch_specific_target, find_cuda_include, nvrtc_present};
use crate::ptx_cache;
use crate::CudaError;

/// A set of CUDA C kernels compiled together with NVRTC.
///
/// ```
/// use lifecycle_cuda::KernelSet;
/// const SCALE: KernelSet = KernelSet::new(
///     "example scale",
///     r#"extern "C" __global__ void scale(float* x, float a, unsigned n) {
///         unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
///         if (i < n) x[i] *= a;
///     }"#,
/// );
/// assert!(!SCALE.exact_math);
/// assert!(SCALE.exact().exact_math);
/// assert!(SCALE.arch_specific().arch_specific);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelSet {
    /// Name in errors and in the caches (unique per source).
    pub name: &'static str,
    /// CUDA C source.
    pub source: &'static str,
    /// IEEE-exact arithmetic (no contraction into fused multiply-adds, correctly rounded division
    /// and square root, denormals kept), for kernels that must match a CPU twin bit for bit.
    pub exact_math: bool,
    /// The source includes CUDA headers (`cuda_bf16.h`): the CUDA include folder is passed.
    pub cuda_headers: bool,
    /// Compiled for the device's architecture-specific target only (`sm_90a` on compute
    /// capability 9.0, whose warpgroup instructions such as `wgmma` no other target has; see
    /// [`arch_specific_target`]): loading fails on devices without one.
    pub arch_specific: bool,
}

impl KernelSet {
    /// A set with default arithmetic and no CUDA headers.
    pub const fn new(name: &'static str, source: &'static str) -> Self {
        KernelSet {
            name,
            source,
            exact_math: false,
            cuda_headers: false,
            arch_specific: false,
        }
    }

    /// The same set compiled with IEEE-exact arithmetic.
    pub const fn exact(self) -> Self {
        KernelSet {
            exact_math: true,
            ..self
        }
    }

    /// The same set compiled with the CUDA include folder.
    pub const fn with_cuda_headers(self) -> Self {
        KernelSet {
            cuda_headers: true,
            ..self
        }
    }

    /// The same set compiled for the device's architecture-specific target only.
    pub const fn arch_specific(self) -> Self {
        KernelSet {
            arch_specific: true,
            ..self
        }
    }

    /// The `--gpu-architecture` values tried for a device of compute capability
    /// (`major`, `minor`).
    fn targets(&self, major: i32, minor: i32) -> Result<Vec<String>, CudaError> {
        if !self.arch_specific {
            return Ok(arch_candidates(major, minor));
        }
        arch_specific_target(major, minor)
            .map(|t| vec![t])
            .ok_or_else(|| CudaError::Compile {
                module: self.name.into(),
                options: Vec::new(),
                detail: format!(
                    "its kernels need an architecture-specific target (sm_90a), which a \
                     device of compute capability {major}.{minor} does not have"
                ),
            })
    }

    fn options(&self, arch: &str) -> CompileOptions {
        let mut opts = CompileOptions {
            options: vec![format!("--gpu-architecture={arch}")],
            ..Default::default()
        };
        if self.exact_math {
            opts.fmad = Some(false);
            opts.prec_div = Some(true);
            opts.prec_sqrt = Some(true);
            opts.ftz = Some(false);
        }
        if self.cuda_headers
            && let Some(p) = find_cuda_include()
        {
            opts.include_paths.push(p.display().to_string());
        }
        opts
    }
}

type PtxKey = (&'static str, &'static str, bool, bool, bool, i32, i32);

fn ptx_cache() -> &'static Mutex<HashMap<PtxKey, Ptx>> {
    static CACHE: OnceLock<Mutex<HashMap<PtxKey, Ptx>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// The PTX of `set` for compute capability (`major`, `minor`), compiled on the first call of the
/// process (trying the architectures of [`arch_candidates`] in order) and cached in the process,
/// and, where `LIFECYCLE_KERNEL_CACHE` names a folder, on disk for the next processes (NVRTC's
/// seconds per set paid once per machine); the error lists every attempt and the fix.
pub fn compile(set: &KernelSet, major: i32, minor: i32) -> Result<Ptx, CudaError> {
    let key = (
        set.name,
        set.source,
        set.exact_math,
        set.cuda_headers,
        set.arch_specific,
        major,
        minor,
    );
    if let Some(p) = ptx_cache()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&key)
    {
        return Ok(p.clone());
    }
    let mut failures = Vec::new();
    let mut last_options = Vec::new();
    // the PTX an earlier process compiled, where the disk cache has it (ptx_cache)
    let disk = ptx_cache::cache_dir()
        .filter(|_| nvrtc_present())
        .and_then(|dir| ptx_cache::nvrtc_version().map(|v| (dir, v)));
    let keep = |ptx: &Ptx| {
        ptx_cache()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, ptx.clone());
    };
    for arch in set.targets(major, minor)? {
        let opts = set.options(&arch);
        last_options = opts.options.clone();
        let file = disk
            .as_ref()
            .map(|(dir, v)| ptx_cache::file_of(dir, set.name, set.source, &opts, *v));
        if let Some(ptx) = file.as_deref().and_then(ptx_cache::read) {
            keep(&ptx);
            return Ok(ptx);
        }
        match compile_ptx_with_opts(set.source, opts) {
            Ok(ptx) => {
                if let (Some(file), Some(text)) = (&file, ptx_cache::text_of(&ptx)) {
                    ptx_cache::write(file, text);
                }
                keep(&ptx);
                return Ok(ptx);
            }
            Err(e) => failures.push(format!("{arch}: {e:?}")),
        }
    }
    let include_hint = if set.cuda_headers {
        " and LIFECYCLE_CUDA_INCLUDE to the folder holding cuda_bf16.h"
    } else {
        ""
    };
    Err(CudaError::Compile {
        module: set.name.into(),
        options: last_options,
        detail: format!(
            "{}; set LIFECYCLE_CUDA_ARCH (e.g. sm_90) to the GPU's architecture{include_hint} \
             if the defaults do not fit",
            failures.join("; ")
        ),
    })
}

/// A [`KernelSet`] loaded into one rank's context.
#[derive(Debug)]
pub struct LoadedModule {
    module: Arc<CudaModule>,
    name: &'static str,
    rank: usize,
    sm_count: u32,
}

impl LoadedModule {
    /// The kernel `name` of the set.
    pub fn function(&self, name: &str) -> Result<CudaFunction, CudaError> {
        self.module.load_function(name).map_err(|e| {
            CudaError::driver(
                self.rank,
                format!("loading kernel {name} of {}", self.name),
                0,
                e,
            )
        })
    }

    /// Streaming multiprocessors of the device (for launch shapes).
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }
}

/// The sets one rank context has loaded (see [`RankCtx::module`](crate::RankCtx::module)).
#[derive(Debug, Default)]
pub(crate) struct ModuleCache(Mutex<HashMap<KernelSet, Arc<LoadedModule>>>);

impl ModuleCache {
    /// `set` loaded into `ctx` (compiled and loaded on first use).
    pub(crate) fn get(
        &self,
        ctx: &Arc<CudaContext>,
        set: &KernelSet,
        rank: usize,
        sm_count: u32,
    ) -> Result<Arc<LoadedModule>, CudaError> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = map.get(set) {
            return Ok(m.clone());
        }
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| CudaError::driver(rank, "reading the compute capability", 0, e))?;
        let ptx = compile(set, major, minor)?;
        let module = ctx.load_module(ptx).map_err(|e| {
            CudaError::driver(rank, format!("loading the module {}", set.name), 0, e)
        })?;
        let loaded = Arc::new(LoadedModule {
            module,
            name: set.name,
            rank,
            sm_count,
        });
        map.insert(*set, loaded.clone());
        Ok(loaded)
    }
}

/// Streaming multiprocessors of the device of `ctx` (read once per rank context).
pub(crate) fn read_sm_count(ctx: &Arc<CudaContext>, rank: usize) -> Result<u32, CudaError> {
    let n = ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .map_err(|e| CudaError::driver(rank, "reading the SM count", 0, e))?;
    Ok(n.max(1) as u32)
}
