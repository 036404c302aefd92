//! What the rollout's small device operations cost while an offload's device-to-host copies run
//! on the copy stream: for each kind of operation (a kernel, small downloads into pinned and
//! pageable memory, a small upload, a stream-ordered allocation), the big copy is queued on the
//! copy stream, then the operation timed on the compute stream, with the copy's own time beside
//! it. An operation that waits for the copy takes about as long as the copy.
//!
//! ```text
//! cargo run --release -p lifecycle-bench --bin overlap_probe -- [--gib 8] [--chunk-mib 1024,64]
//! ```

use std::time::Instant;

use clap::Parser;
use lifecycle_cuda::cudarc::driver::{
    result, sys, CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg,
};
use lifecycle_cuda::{
    alloc_device, alloc_pinned, CudaError, KernelSet, RankCtx, RankExecutor, ThreadRankPool,
};

/// See the module docs.
#[derive(Debug, Parser)]
#[command(name = "overlap_probe")]
struct Cli {
    /// GiB the big device-to-host copy moves.
    #[arg(long, default_value_t = 8)]
    gib: usize,
    /// Sizes of the pieces the big copy is queued in, MiB.
    #[arg(long, value_delimiter = ',', default_value = "1024,64")]
    chunk_mib: Vec<usize>,
    /// Pauses between the pieces (a sleeping kernel on the copy stream), microseconds; 0: none.
    /// With a pause only the SM writes are timed.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    gap_us: Vec<u32>,
}

/// The probe's kernels (`kernels/overlap_probe.cu`).
const PROBE: KernelSet = KernelSet::new(
    "overlap probe",
    include_str!("../../../kernels/overlap_probe.cu"),
);

const OPS: [&str; 8] = [
    "kernel (memset 4 KiB)",
    "download 4 KiB into pinned memory",
    "download 4 KiB into pageable memory",
    "upload 4 KiB from pageable memory",
    "alloc + free 1 GiB (stream-ordered)",
    "download 4 KiB, pinned, through the aux stream",
    "SM write of 4 KiB into mapped pinned memory",
    "SM write of 128 B into mapped pinned memory, x17",
];

struct Mapped {
    dev: u64,
    write: CudaFunction,
}

fn sm_write(ctx: &RankCtx, m: &Mapped, words: u64) -> Result<(), CudaError> {
    let s = &ctx.compute;
    let mut b = s.launch_builder(&m.write);
    b.arg(&m.dev);
    b.arg(&words);
    let cfg = LaunchConfig {
        grid_dim: (4, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `dev` maps 4 KiB of pinned memory; the kernel writes `words` ≤ 1024 words there.
    unsafe { b.launch(cfg) }.map_err(ctx.drv("write_words", 4 * words))?;
    s.synchronize().map_err(ctx.drv("sync", 0))
}

fn run_op(
    ctx: &RankCtx,
    op: usize,
    small: &mut CudaSlice<u8>,
    m: &Mapped,
) -> Result<(), CudaError> {
    let s = &ctx.compute;
    match op {
        6 => return sm_write(ctx, m, 1024),
        7 => {
            for _ in 0..17 {
                sm_write(ctx, m, 32)?;
            }
            return Ok(());
        }
        0 => s.memset_zeros(small).map_err(ctx.drv("memset", 4096))?,
        1 | 5 => {
            let st = if op == 5 { &ctx.aux } else { s };
            // SAFETY: written by the copy below before it is read (never read here).
            let mut h = unsafe { alloc_pinned::<u8>(st, 4096, ctx.rank, "pinned")? };
            st.memcpy_dtoh(small, &mut h)
                .map_err(ctx.drv("pinned download", 4096))?;
            st.synchronize().map_err(ctx.drv("sync", 0))?;
        }
        2 => {
            let _v = s
                .clone_dtoh(small)
                .map_err(ctx.drv("pageable download", 4096))?;
        }
        3 => {
            let v = vec![1u8; 4096];
            s.memcpy_htod(&v, small)
                .map_err(ctx.drv("pageable upload", 4096))?;
        }
        _ => {
            // SAFETY: never read.
            let big = unsafe { alloc_device::<u8>(s, 1 << 30, ctx.rank, "1 GiB")? };
            drop(big);
        }
    }
    s.synchronize().map_err(ctx.drv("sync", 0))
}

fn probe(
    ctx: &RankCtx,
    gib: usize,
    chunks: &[usize],
    gap_us: &[u32],
) -> Result<Vec<String>, CudaError> {
    let module = ctx.module(&PROBE)?;
    // SAFETY: written by the probe's kernels only.
    let mapped_host = unsafe {
        ctx.ctx
            .alloc_pinned_with_flags::<u32>(1024, sys::CU_MEMHOSTALLOC_DEVICEMAP)
    }
    .map_err(ctx.drv("mapped pinned memory", 4096))?;
    let mut dev = 0;
    // SAFETY: allocated with DEVICEMAP in this context; `dev` is a valid out-pointer.
    unsafe {
        let p = mapped_host.as_ptr().map_err(ctx.drv("mapped", 0))?;
        sys::cuMemHostGetDevicePointer_v2(&mut dev, p as *mut _, 0)
    }
    .result()
    .map_err(ctx.drv("mapping", 4096))?;
    let m = Mapped {
        dev,
        write: module.function("write_words")?,
    };
    let spin = module.function("spin")?;
    let bytes = gib << 30;
    // SAFETY: only read by the copies (its contents do not matter).
    let dev = unsafe { alloc_device::<u8>(&ctx.compute, bytes, ctx.rank, "source")? };
    ctx.compute.synchronize().map_err(ctx.drv("sync", 0))?;
    // SAFETY: written by the copies, never read.
    let host =
        unsafe { result::malloc_host(bytes, 0) }.map_err(ctx.drv("pinning", bytes as u64))?;
    let mut small = ctx
        .compute
        .alloc_zeros::<u8>(4096)
        .map_err(ctx.drv("small", 4096))?;
    let src = dev.device_ptr(&ctx.copy).0;
    let mut out = Vec::new();
    for (&chunk_mib, &gap) in chunks
        .iter()
        .flat_map(|c| gap_us.iter().map(move |g| (c, g)))
    {
        let chunk = (chunk_mib << 20).min(bytes).max(1);
        for (op, name) in OPS.iter().enumerate() {
            if gap > 0 && op < 6 {
                continue;
            }
            let t = Instant::now();
            let mut off = 0;
            while off < bytes {
                let n = chunk.min(bytes - off);
                // SAFETY: `src + off .. + n` lies in `dev`, `host + off .. + n` in the pinned
                // allocation; both outlive the copy (the stream is synchronised below).
                unsafe {
                    sys::cuMemcpyDtoHAsync_v2(
                        (host as *mut u8).add(off).cast(),
                        src + off as u64,
                        n,
                        ctx.copy.cu_stream(),
                    )
                }
                .result()
                .map_err(ctx.drv("the big copy", n as u64))?;
                off += n;
                if gap > 0 {
                    let mut b = ctx.copy.launch_builder(&spin);
                    let ns = gap * 1000;
                    b.arg(&ns);
                    // SAFETY: the kernel takes one u32 and touches no memory.
                    unsafe { b.launch(LaunchConfig::for_num_elems(1)) }
                        .map_err(ctx.drv("spin", 0))?;
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
            let t_op = Instant::now();
            run_op(ctx, op, &mut small, &m)?;
            let op_ms = t_op.elapsed().as_secs_f64() * 1e3;
            // SAFETY: a query of a live stream.
            let busy = unsafe { sys::cuStreamQuery(ctx.copy.cu_stream()) }
                == sys::CUresult::CUDA_ERROR_NOT_READY;
            ctx.copy.synchronize().map_err(ctx.drv("sync", 0))?;
            let copy_ms = t.elapsed().as_secs_f64() * 1e3;
            out.push(format!(
                "chunks {chunk_mib:>5} MiB, gaps {gap:>3} us | {name:<48} | {op_ms:>9.3} ms | copy still running \
                 after it: {busy:<5} | copy {copy_ms:>7.1} ms ({:.1} GB/s)",
                bytes as f64 / copy_ms / 1e6
            ));
        }
    }
    // SAFETY: allocated by malloc_host above; no copy into it is pending (synchronised).
    unsafe { result::free_host(host) }.map_err(ctx.drv("unpinning", 0))?;
    drop(dev);
    Ok(out)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cli = Cli::parse();
    let pool = ThreadRankPool::new(1)?;
    let (gib, chunks, gaps) = (cli.gib, cli.chunk_mib.clone(), cli.gap_us.clone());
    let lines = pool.run(&|ctx| probe(ctx, gib, &chunks, &gaps))?;
    for l in lines.into_iter().flatten() {
        println!("{l}");
    }
    Ok(())
}
