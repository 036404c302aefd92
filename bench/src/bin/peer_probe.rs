//! Measures how fast GPUs of one process move bytes between each other without NCCL: copy
//! engines (`cuMemcpyDtoDAsync` / `cuMemcpy2DAsync` between peer-mapped buffers) and SM copy
//! kernels that read or write the peer's memory directly, all GPUs at once in both directions,
//! alone and next to a local device-to-device copy that loads HBM.
//!
//! ```text
//! cargo run --release -p lifecycle-bench --bin peer_probe -- [--gpus 2] [--mib 1024] [--iters 5]
//! ```
//!
//! Prints, per method, the best time of `--iters` runs and the receive rate per GPU.

use lifecycle_cuda::memcpy_2d_desc as copy_2d;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use lifecycle_cuda::cudarc::driver::sys;
use lifecycle_cuda::cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
};
use lifecycle_cuda::cudarc::driver::{DevicePtrMut, PushKernelArg};
use lifecycle_cuda::KernelSet;

const SRC: &str = include_str!("../../../kernels/peer_probe.cu");

const PROBE_KERNELS: KernelSet = KernelSet::new("peer probe kernels", SRC);

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Measures how fast the GPUs of one process move bytes between each other without NCCL: copy
/// engines and SM copy kernels reading or writing the peer's memory, all GPUs at once in both
/// directions, alone and next to a local device-to-device copy.
#[derive(Debug, Parser)]
#[command(name = "peer_probe")]
struct Cli {
    /// GPUs, each copying to the next (the last to the first).
    #[arg(long, default_value_t = 2)]
    gpus: usize,
    /// MiB each GPU sends and receives per run.
    #[arg(long, default_value_t = 1024)]
    mib: usize,
    /// Timed runs of each method; the best is reported.
    #[arg(long, default_value_t = 5)]
    iters: usize,
}

struct Gpu {
    ctx: Arc<CudaContext>,
    net: Arc<CudaStream>,
    net2: Arc<CudaStream>,
    local: Arc<CudaStream>,
    copy16: CudaFunction,
    copy2d: CudaFunction,
    sms: u32,
    /// Source of outgoing bytes (read by peers or pushed), 2x the message for 2-D runs.
    send: CudaSlice<u8>,
    /// Destination of incoming bytes.
    recv: CudaSlice<u8>,
    /// Local copy load.
    load_src: CudaSlice<u8>,
    load_dst: CudaSlice<u8>,
}

fn ptr(s: &CudaSlice<u8>, st: &CudaStream) -> u64 {
    let (p, _g) = s.device_ptr(st);
    p
}

fn ptr_mut(s: &mut CudaSlice<u8>, st: &CudaStream) -> u64 {
    let (p, _g) = s.device_ptr_mut(st);
    p
}

#[derive(Clone, Copy, PartialEq)]
enum Method {
    CePush,
    CePull,
    SmPull,
    SmPush,
    SmPull2d,
    CePull2d,
    CePush2d,
    CePush2dDst,
    CePull2dDst,
    CePush2dTwo,
    CePushTwo,
}

/// The probe. Long by design: it is the report's script, one copy method after another in the
/// order the report prints them, each timed against the same buffers.
fn main() -> Res<()> {
    let Cli {
        gpus: gpus_n,
        mib,
        iters,
    } = Cli::parse();
    // SAFETY: only probes whether the library can be loaded.
    if !unsafe { sys::is_culib_present() } {
        return Err("libcuda not found".into());
    }
    let bytes = mib << 20;
    let mut gpus = Vec::new();
    for g in 0..gpus_n {
        let ctx = CudaContext::new(g)?;
        let (major, minor) = ctx.compute_capability()?;
        let ptx = lifecycle_cuda::compile(&PROBE_KERNELS, major, minor)?;
        let m = ctx.load_module(ptx)?;
        let net = ctx.new_stream()?;
        let net2 = ctx.new_stream()?;
        let local = ctx.new_stream()?;
        let sms =
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        gpus.push(Gpu {
            copy16: m.load_function("copy16")?,
            copy2d: m.load_function("copy2d16")?,
            sms: sms as u32,
            send: net.alloc_zeros::<u8>(2 * bytes)?,
            recv: net.alloc_zeros::<u8>(2 * bytes)?,
            load_src: local.alloc_zeros::<u8>(4 << 30)?,
            load_dst: local.alloc_zeros::<u8>(4 << 30)?,
            ctx,
            net,
            net2,
            local,
        });
    }
    for g in &gpus {
        g.net.synchronize()?;
        g.local.synchronize()?;
    }
    // Peer access both ways.
    for (i, g) in gpus.iter().enumerate() {
        g.ctx.bind_to_thread()?;
        for (j, h) in gpus.iter().enumerate() {
            if i == j {
                continue;
            }
            let mut can = 0i32;
            // SAFETY: valid out-pointer and device ordinals of this machine.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, g.ctx.cu_device(), h.ctx.cu_device()) }
                .result()?;
            println!("GPU {i} can access GPU {j}: {}", can != 0);
            // SAFETY: both contexts are alive; flags must be 0.
            let r = unsafe { sys::cuCtxEnablePeerAccess(h.ctx.cu_ctx(), 0) };
            if r != sys::CUresult::CUDA_SUCCESS
                && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            {
                return Err(format!("enabling peer access {i} -> {j}: {r:?}").into());
            }
            // Stream-ordered pool memory needs the pool's own grant for the peer device.
            let mut pool = std::mem::MaybeUninit::uninit();
            // SAFETY: valid out-pointer; device of a live context.
            unsafe { sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), h.ctx.cu_device()) }
                .result()?;
            // SAFETY: initialised by the call above.
            let pool = unsafe { pool.assume_init() };
            let desc = sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: g.ctx.cu_device(),
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: one valid descriptor.
            unsafe { sys::cuMemPoolSetAccess(pool, &desc, 1) }.result()?;
        }
    }
    let n = gpus.len();
    let sends: Vec<u64> = gpus.iter().map(|g| ptr(&g.send, &g.net)).collect();
    let recvs: Vec<u64> = gpus
        .iter_mut()
        .map(|g| {
            let st = g.net.clone();
            ptr_mut(&mut g.recv, &st)
        })
        .collect();
    let launch = |g: &Gpu, i: usize, m: Method, blocks_per_sm: u32| -> Res<()> {
        let peer = (i + 1) % n;
        g.ctx.bind_to_thread()?;
        let cfg = LaunchConfig {
            grid_dim: (g.sms * blocks_per_sm, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: 0,
        };
        match m {
            Method::CePush | Method::CePull => {
                let (dst, src) = if m == Method::CePush {
                    (recvs[peer], sends[i])
                } else {
                    (recvs[i], sends[peer])
                };
                // SAFETY: both buffers hold at least `bytes` and stay alive until the streams are
                // synchronised; peer access is enabled above.
                unsafe {
                    lifecycle_cuda::cudarc::driver::result::memcpy_dtod_async(
                        dst,
                        src,
                        bytes,
                        g.net.cu_stream(),
                    )?
                }
            }
            Method::SmPull | Method::SmPush => {
                let (s, d) = if m == Method::SmPull {
                    (sends[peer], recvs[i])
                } else {
                    (sends[i], recvs[peer])
                };
                let words = (bytes / 16) as u64;
                let mut b = g.net.launch_builder(&g.copy16);
                b.arg(&s).arg(&d).arg(&words);
                // SAFETY: arguments match the kernel's parameters; every index stays inside the
                // buffers (2 × `bytes` each), alive until the streams are synchronised.
                unsafe { b.launch(cfg)? };
            }
            Method::SmPull2d => {
                // Rows of 3584 bytes (224 words) from a source with twice that pitch.
                let cols = 224u64;
                let rows = (bytes as u64 / 16) / cols;
                let (spl, dpl) = (2 * cols, cols);
                let mut b = g.net.launch_builder(&g.copy2d);
                b.arg(&sends[peer])
                    .arg(&recvs[i])
                    .arg(&rows)
                    .arg(&cols)
                    .arg(&spl)
                    .arg(&dpl);
                // SAFETY: arguments match the kernel's parameters; every index stays inside the
                // buffers (2 × `bytes` each), alive until the streams are synchronised.
                unsafe { b.launch(cfg)? };
            }
            Method::CePush2d | Method::CePush2dTwo => {
                let w = 3584usize;
                let rows = bytes / w;
                let parts = if m == Method::CePush2dTwo { 2 } else { 1 };
                for p in 0..parts {
                    let (r0, r1) = (rows * p / parts, rows * (p + 1) / parts);
                    let c = copy_2d(
                        (sends[i] + (r0 * 2 * w) as u64, 2 * w),
                        (recvs[peer] + (r0 * w) as u64, w),
                        w,
                        r1 - r0,
                    );
                    let st = if p == 0 { &g.net } else { &g.net2 };
                    // SAFETY: the descriptor is valid for the call; every row lies inside buffers of
                    // 2 × `bytes`, alive until the streams are synchronised; peer access is enabled.
                    unsafe { sys::cuMemcpy2DAsync_v2(&c, st.cu_stream()) }.result()?;
                }
            }
            Method::CePush2dDst | Method::CePull2dDst => {
                // Dense rows of 3584 bytes into a destination with twice that pitch.
                let w = 3584usize;
                let rows = bytes / w;
                let (src, dst) = if m == Method::CePush2dDst {
                    (sends[i], recvs[peer])
                } else {
                    (sends[peer], recvs[i])
                };
                let c = copy_2d((src, w), (dst, 2 * w), w, rows);
                // SAFETY: the descriptor is valid for the call; every row lies inside buffers of
                // 2 × `bytes`, alive until the streams are synchronised; peer access is enabled.
                unsafe { sys::cuMemcpy2DAsync_v2(&c, g.net.cu_stream()) }.result()?;
            }
            Method::CePushTwo => {
                let half = bytes / 2;
                for (p, st) in [&g.net, &g.net2].into_iter().enumerate() {
                    // SAFETY: both halves lie inside buffers of 2 × `bytes`, alive until the streams
                    // are synchronised; peer access is enabled.
                    unsafe {
                        lifecycle_cuda::cudarc::driver::result::memcpy_dtod_async(
                            recvs[peer] + (p * half) as u64,
                            sends[i] + (p * half) as u64,
                            half,
                            st.cu_stream(),
                        )?
                    };
                }
            }
            Method::CePull2d => {
                let w = 3584usize;
                let rows = bytes / w;
                let c = copy_2d((sends[peer], 2 * w), (recvs[i], w), w, rows);
                // SAFETY: the descriptor is valid for the call; every row lies inside buffers of
                // 2 × `bytes`, alive until the streams are synchronised; peer access is enabled.
                unsafe { sys::cuMemcpy2DAsync_v2(&c, g.net.cu_stream()) }.result()?;
            }
        }
        Ok(())
    };
    let load = |g: &Gpu| -> Res<()> {
        g.ctx.bind_to_thread()?;
        let (s, _a) = g.load_src.device_ptr(&g.local);
        let (d, _b) = g.load_dst.device_ptr(&g.local);
        // SAFETY: both 4 GiB buffers are alive for the run.
        unsafe {
            lifecycle_cuda::cudarc::driver::result::memcpy_dtod_async(
                d,
                s,
                4 << 30,
                g.local.cu_stream(),
            )?
        };
        Ok(())
    };
    let methods = [
        ("CE push (cuMemcpyDtoD to peer)", Method::CePush, 0),
        ("CE pull (cuMemcpyDtoD from peer)", Method::CePull, 0),
        ("SM pull, 1 block/SM", Method::SmPull, 1),
        ("SM pull, 2 blocks/SM", Method::SmPull, 2),
        ("SM pull, 4 blocks/SM", Method::SmPull, 4),
        ("SM push, 2 blocks/SM", Method::SmPush, 2),
        ("SM push, 4 blocks/SM", Method::SmPush, 4),
        ("SM pull 2-D rows 3584 B, 2 blocks/SM", Method::SmPull2d, 2),
        ("CE pull 2-D rows 3584 B", Method::CePull2d, 0),
        ("CE push 2-D rows 3584 B", Method::CePush2d, 0),
        ("CE push 2-D rows 3584 B, 2 streams", Method::CePush2dTwo, 0),
        ("CE push 2-D into pitch 7168 B", Method::CePush2dDst, 0),
        ("CE pull 2-D into pitch 7168 B", Method::CePull2dDst, 0),
        ("CE push, 2 streams", Method::CePushTwo, 0),
    ];
    println!(
        "peer_probe: {n} GPUs, {mib} MiB per GPU and direction, all GPUs at once, best of {iters}"
    );
    for with_load in [false, true] {
        for (name, m, bps) in methods {
            let mut best = f64::MAX;
            let mut best_load = f64::MAX;
            for _ in 0..iters + 1 {
                for g in &gpus {
                    g.net.synchronize()?;
                    g.net2.synchronize()?;
                    g.local.synchronize()?;
                }
                let t = Instant::now();
                for (i, g) in gpus.iter().enumerate() {
                    if with_load {
                        load(g)?;
                    }
                    launch(g, i, m, bps.max(1))?;
                }
                for g in &gpus {
                    g.net.synchronize()?;
                    g.net2.synchronize()?;
                }
                let net = t.elapsed().as_secs_f64();
                for g in &gpus {
                    g.local.synchronize()?;
                }
                let all = t.elapsed().as_secs_f64();
                best = best.min(net);
                best_load = best_load.min(all);
            }
            let rate = bytes as f64 / best / 1e9;
            if with_load {
                println!(
                    "  {name:<40} + 4 GiB local copy: peer {:.2} ms ({rate:.1} GB/s), all done {:.2} ms",
                    best * 1e3,
                    best_load * 1e3
                );
            } else {
                println!("  {name:<40} {:.2} ms ({rate:.1} GB/s)", best * 1e3);
            }
        }
    }
    // Local copy alone, for the contention lines.
    let mut best = f64::MAX;
    for _ in 0..iters {
        let t = Instant::now();
        for g in &gpus {
            load(g)?;
        }
        for g in &gpus {
            g.local.synchronize()?;
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!("  4 GiB local copy alone: {:.2} ms", best * 1e3);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lifecycle_bench::cli::{assert_parses, assert_refused};

    #[test]
    fn copy_descriptors() {
        let c = copy_2d((0x1000, 7168), (0x9000, 3584), 3584, 10);
        assert_eq!((c.srcDevice, c.srcPitch), (0x1000, 7168));
        assert_eq!((c.dstDevice, c.dstPitch), (0x9000, 3584));
        assert_eq!((c.WidthInBytes, c.Height), (3584, 10));
    }

    #[test]
    fn documented_command_lines() {
        let [d, all] = assert_parses::<Cli, 2>(["", "--gpus 2 --mib 1024 --iters 5"]);
        assert_eq!((d.gpus, d.mib, d.iters), (2, 1024, 5));
        assert_eq!((all.gpus, all.mib, all.iters), (2, 1024, 5));
        assert_refused::<Cli>(&["--mib", "--gpus two", "--bogus"]);
    }
}
