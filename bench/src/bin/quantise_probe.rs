//! How fast the fp8 quantisation kernel (`kernels/fp8_quantise.cu`) runs on this GPU, and what
//! bounds it: the kernel as shipped (over fp32 the multiply by 1 / s with the IEEE division near
//! e4m3 midpoints, over bf16 the quotient by its fused correction), with other counts of values
//! per thread, with the division for every value, and a diagnostic variant that only
//! multiplies (not bit-exact: the bound of the shipped one). One region of `--rows` ×
//! `--cols` fp32 values (bf16 with `--bf16`: the kernel the Megatron backends' fp8 pass runs),
//! against the device-to-device copy floor of the same bytes.
//!
//! ```text
//! cargo run --release -p lifecycle-bench --bin quantise_probe -- [--rows 32768] [--cols 32768] [--bf16]
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
    /// Quantise bf16 values (`quantize_e4m3_jobs_bf16`) instead of fp32.
    #[arg(long)]
    bf16: bool,
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
    // the source as 32-bit words: fp32 values, or two bf16 values a word (the high halves)
    let words: Vec<u32> = if cli.bf16 {
        host.chunks(2)
            .map(|p| (p[0].to_bits() >> 16) | (p.get(1).map_or(0, |v| v.to_bits() >> 16) << 16))
            .collect()
    } else {
        host.iter().map(|v| v.to_bits()).collect()
    };
    let src: CudaSlice<u32> = stream.clone_htod(&words)?;
    drop((host, words));
    let src_bytes = if cli.bf16 { 2 } else { 4 };
    // the bytes, then one f32 scale per tile
    let out_bytes = n + 4 * tiles as usize;
    let dst: CudaSlice<u8> = stream.alloc_zeros(out_bytes.next_multiple_of(4))?;
    let jobs = stream.clone_htod(&[0u64, 0, (n / 4) as u64, cli.rows, cli.cols, 0, cli.cols])?;
    // a copy of (src + 1) n / 2 bytes reads and writes the bytes the quantisation moves
    let moved = (src_bytes + 1) * n;
    let copy_src: CudaSlice<u8> = stream.alloc_zeros(moved / 2)?;
    let mut copy_dst: CudaSlice<u8> = stream.alloc_zeros(moved / 2)?;
    let floor = best_ms(&stream, cli.iters, || {
        stream.memcpy_dtod(&copy_src, &mut copy_dst)?;
        Ok(())
    })?;
    let gb = moved as f64 / 1e9;
    println!(
        "quantise_probe: {} x {} {} ({:.2} GB read, {:.2} GB written); floor (a device copy \
         moving as many bytes) {floor:.3} ms ({:.0} GB/s)",
        cli.rows,
        cli.cols,
        if cli.bf16 { "bf16" } else { "fp32" },
        (src_bytes * n) as f64 / 1e9,
        n as f64 / 1e9,
        gb / floor * 1e3
    );
    // (float4s' worth of values per thread, a macro the kernel reads); the shipped count is
    // 8 over fp32, 16 over bf16 (its loads kept packed)
    let shipped = if cli.bf16 { 16 } else { 8 };
    let held_macro = if cli.bf16 {
        "QUANTISE_HELD_BF16"
    } else {
        "QUANTISE_HELD"
    };
    let variants: [(usize, &str); 6] = [
        (32, ""),
        (16, ""),
        (8, ""),
        (4, ""),
        (shipped, "QUANTISE_DIVIDE_ALWAYS"),
        (shipped, "QUANTISE_MULTIPLY_ONLY"),
    ];
    for (held, flag) in variants {
        let threads = 32 * (128 / held) as u32;
        let name = match flag {
            "" if held == shipped => format!(
                "shipped ({} values per thread, {threads} threads)",
                4 * held
            ),
            "" => format!("{} values per thread, {threads} threads", 4 * held),
            "QUANTISE_DIVIDE_ALWAYS" => "shipped, the IEEE division for every value".to_string(),
            _ => "diagnostic: shipped, multiply by 1/s only".to_string(),
        };
        let mut source = format!("#define {held_macro} {held}\n");
        if !flag.is_empty() {
            source.push_str(&format!("#define {flag}\n"));
        }
        source.push_str(SOURCE);
        let source: &'static str = Box::leak(source.into_boxed_str());
        let set = KernelSet::new(Box::leak(name.clone().into_boxed_str()), source).exact();
        let ptx = compile(&set, major, minor)?;
        let module = ctx.load_module(ptx)?;
        let f = module.load_function(if cli.bf16 {
            "quantize_e4m3_jobs_bf16"
        } else {
            "quantize_e4m3_jobs"
        })?;
        let (sp, _s) = src.device_ptr(&stream);
        let (dp, _d) = dst.device_ptr(&stream);
        let count = 1u32;
        let ntiles = tiles as u32;
        // no non-finite report (a null flag)
        let no_flag = 0u64;
        let ms = best_ms(&stream, cli.iters, || {
            let mut b = stream.launch_builder(&f);
            b.arg(&sp)
                .arg(&jobs)
                .arg(&count)
                .arg(&ntiles)
                .arg(&dp)
                .arg(&dp)
                .arg(&no_flag);
            let cfg = LaunchConfig {
                // the shipped two tiles a block
                grid_dim: (ntiles.div_ceil(2), 1, 1),
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
