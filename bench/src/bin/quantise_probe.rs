//! How fast the fp8 quantisation kernel (`kernels/fp8_quantise.cu`) runs on this GPU, and what
//! bounds it: the kernel as shipped, with fewer float4s per thread (more threads per block), and
//! a diagnostic variant that multiplies by the reciprocal of the scale instead of dividing (not
//! bit-exact: it says how much of the time the IEEE division costs). One region of `--rows` ×
//! `--cols` fp32 values, against the device-to-device copy floor of the same bytes.
//!
//! ```text
//! cargo run --release -p lifecycle-bench --bin quantise_probe -- [--rows 32768] [--cols 32768]
//! ```

use std::sync::Arc;

use clap::Parser;
use lifecycle_cuda::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use lifecycle_cuda::cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use lifecycle_cuda::{compile, KernelSet};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SOURCE: &str = include_str!("../../../kernels/fp8_quantise.cu");
const DIVIDE: &str = "float a = v.x / s, b = v.y / s, c = v.z / s, d = v.w / s;";
const MULTIPLY: &str =
    "float inv = 1.0f / s; float a = v.x * inv, b = v.y * inv, c = v.z * inv, d = v.w * inv;";

/// The quantisation kernel's speed by variant (see the module docs).
#[derive(Debug, Parser)]
#[command(name = "quantise_probe")]
struct Cli {
    /// Rows of the fp32 region.
    #[arg(long, default_value_t = 32768)]
    rows: u64,
    /// Columns of the fp32 region.
    #[arg(long, default_value_t = 32768)]
    cols: u64,
    /// Timed launches per variant (the best is reported).
    #[arg(long, default_value_t = 10)]
    iters: usize,
}

fn best_ms(stream: &Arc<CudaStream>, iters: usize, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    f()?;
    let mut best = f64::MAX;
    for _ in 0..iters {
        let a = stream.record_event(Some(CU_EVENT_DEFAULT))?;
        f()?;
        let b = stream.record_event(Some(CU_EVENT_DEFAULT))?;
        b.synchronize()?;
        best = best.min(a.elapsed_ms(&b)? as f64);
    }
    Ok(best)
}

fn main() -> Res<()> {
    let cli = Cli::parse();
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let (major, minor) = ctx.compute_capability()?;
    let n = (cli.rows * cli.cols) as usize;
    let tiles = cli.rows.div_ceil(128) * cli.cols.div_ceil(128);
    // values spread over a few binades, as weights are (a cheap LCG: the data only needs to be
    // non-trivial for the division and the conversion)
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let host: Vec<f32> = (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
        })
        .collect();
    let src: CudaSlice<f32> = stream.clone_htod(&host)?;
    drop(host);
    // the bytes, then one f32 scale per tile
    let out_bytes = n + 4 * tiles as usize;
    let dst: CudaSlice<u8> = stream.alloc_zeros(out_bytes.next_multiple_of(4))?;
    let jobs = stream.clone_htod(&[0u64, 0, (n / 4) as u64, cli.rows, cli.cols, 0])?;
    // a copy of 2.5 n bytes reads and writes the 5 n bytes the quantisation moves
    let copy_src: CudaSlice<u8> = stream.alloc_zeros(5 * n / 2)?;
    let mut copy_dst: CudaSlice<u8> = stream.alloc_zeros(5 * n / 2)?;
    let floor = best_ms(&stream, cli.iters, || {
        stream.memcpy_dtod(&copy_src, &mut copy_dst)?;
        Ok(())
    })?;
    let gb = (5 * n) as f64 / 1e9;
    println!(
        "quantise_probe: {} x {} fp32 ({:.2} GB read, {:.2} GB written); floor (a device copy \
         moving as many bytes) {floor:.3} ms ({:.0} GB/s)",
        cli.rows,
        cli.cols,
        (4 * n) as f64 / 1e9,
        n as f64 / 1e9,
        gb / floor * 1e3
    );
    let variants: [(&str, usize, bool); 5] = [
        ("16 float4 per thread, 256 threads", 16, false),
        ("shipped (8 float4 per thread, 512 threads)", 8, false),
        ("4 float4 per thread, 1024 threads", 4, false),
        ("diagnostic: 16 per thread, multiply by 1/s", 16, true),
        ("diagnostic: 8 per thread, multiply by 1/s", 8, true),
    ];
    for (name, held, multiply) in variants {
        let mut source = format!("#define QUANTISE_HELD {held}\n{SOURCE}");
        if multiply {
            if !source.contains(DIVIDE) {
                return Err("the kernel's division line changed: update the probe".into());
            }
            source = source.replace(DIVIDE, MULTIPLY);
        }
        let source: &'static str = Box::leak(source.into_boxed_str());
        let set = KernelSet::new(Box::leak(name.to_string().into_boxed_str()), source).exact();
        let ptx = compile(&set, major, minor)?;
        let module = ctx.load_module(ptx)?;
        let f = module.load_function("quantize_e4m3_jobs")?;
        let threads = 32 * (128 / held) as u32;
        let (sp, _s) = src.device_ptr(&stream);
        let (dp, _d) = dst.device_ptr(&stream);
        let count = 1u32;
        let ntiles = tiles as u32;
        let ms = best_ms(&stream, cli.iters, || {
            let mut b = stream.launch_builder(&f);
            b.arg(&sp)
                .arg(&jobs)
                .arg(&count)
                .arg(&ntiles)
                .arg(&dp)
                .arg(&dp);
            let cfg = LaunchConfig {
                grid_dim: (ntiles, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the source holds rows x cols floats, the destination the bytes and one
            // scale per tile after them (the job's scale index n / 4); the argument list is the
            // kernel's.
            unsafe { b.launch(cfg) }?;
            Ok(())
        })?;
        println!(
            "  {name:<46} {ms:>7.3} ms  {:>5.0} GB/s  {:.2}x the floor",
            gb / ms * 1e3,
            ms / floor
        );
    }
    Ok(())
}
