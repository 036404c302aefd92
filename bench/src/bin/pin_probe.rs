//! How fast this machine pins host memory, by the two ways the CUDA driver offers: allocating
//! page-locked memory (`cuMemHostAlloc`, what the offload's pinned pool does today) and
//! registering memory the process faulted in itself (`cuMemHostRegister` after touching every
//! page from several threads), each from 1 and more threads; then a device-to-host copy into the
//! registered memory, to check that it copies at the pinned rate.
//!
//! ```text
//! cargo run --release -p lifecycle-bench --bin pin_probe -- [--gib 16] [--threads 1,4,8,16]
//! ```

use std::alloc::{alloc, dealloc, Layout};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use lifecycle_cuda::cudarc::driver::{result, sys, CudaContext};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const GIB: usize = 1 << 30;
const PAGE: usize = 4096;

/// How fast host memory is pinned by allocation and by registration (see the module docs).
#[derive(Debug, Parser)]
#[command(name = "pin_probe")]
struct Cli {
    /// GiB pinned by each method (in 1 GiB chunks).
    #[arg(long, default_value_t = 16)]
    gib: usize,
    /// Thread counts to try.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16")]
    threads: Vec<usize>,
}

fn check(r: sys::CUresult, what: &str) -> Res<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {r:?}").into())
    }
}

/// `cuMemHostAlloc` of `chunks` GiB over `threads` threads; the chunks, freed after timing.
fn by_allocation(ctx: &Arc<CudaContext>, chunks: usize, threads: usize) -> Res<f64> {
    let t = Instant::now();
    let got: Vec<Res<Vec<usize>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|k| {
                s.spawn(move || -> Res<Vec<usize>> {
                    ctx.bind_to_thread()?;
                    let mut mine = Vec::new();
                    for _ in (k..chunks).step_by(threads) {
                        // SAFETY: a fresh page-locked allocation, freed below, never read.
                        let p = unsafe { result::malloc_host(GIB, 0) }?;
                        mine.push(p as usize);
                    }
                    Ok(mine)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a pinning thread panicked".into()))
            })
            .collect()
    });
    let secs = t.elapsed().as_secs_f64();
    for list in got {
        for p in list? {
            // SAFETY: returned by malloc_host above, freed once.
            unsafe { result::free_host(p as *mut c_void) }?;
        }
    }
    Ok(secs)
}

/// Memory faulted in by `threads` threads (a write per page), then registered with the driver:
/// (touch seconds, register seconds, the buffer) — the caller unregisters and frees it.
fn by_registration(
    ctx: &Arc<CudaContext>,
    chunks: usize,
    threads: usize,
) -> Res<(f64, f64, *mut u8, Layout)> {
    let layout = Layout::from_size_align(chunks * GIB, 2 << 20)?;
    // SAFETY: a non-zero size; freed by the caller with the same layout.
    let buf = unsafe { alloc(layout) };
    if buf.is_null() {
        return Err(format!("allocating {chunks} GiB of host memory failed").into());
    }
    let base = buf as usize;
    let t = Instant::now();
    std::thread::scope(|s| {
        for k in 0..threads {
            s.spawn(move || {
                for c in (k..chunks).step_by(threads) {
                    let start = base + c * GIB;
                    for off in (0..GIB).step_by(PAGE) {
                        // SAFETY: inside the allocation; each thread writes its own chunks.
                        unsafe { std::ptr::write_volatile((start + off) as *mut u8, 0) };
                    }
                }
            });
        }
    });
    let touch = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let registered: Vec<Res<()>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|k| {
                s.spawn(move || -> Res<()> {
                    ctx.bind_to_thread()?;
                    for c in (k..chunks).step_by(threads) {
                        // SAFETY: a live, page-aligned 1 GiB range of the allocation, unregistered
                        // by the caller before it is freed.
                        let r = unsafe {
                            sys::cuMemHostRegister_v2((base + c * GIB) as *mut c_void, GIB, 0)
                        };
                        check(r, "cuMemHostRegister")?;
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a registering thread panicked".into()))
            })
            .collect()
    });
    let register = t.elapsed().as_secs_f64();
    for r in registered {
        r?;
    }
    Ok((touch, register, buf, layout))
}

fn unregister(buf: *mut u8, layout: Layout, chunks: usize) {
    for c in 0..chunks {
        // SAFETY: registered by by_registration (an error for a chunk that was not is ignored).
        let _ = unsafe { sys::cuMemHostUnregister(buf.wrapping_add(c * GIB) as *mut c_void) };
    }
    // SAFETY: allocated by by_registration with this layout, no longer registered.
    unsafe { dealloc(buf, layout) };
}

/// A 1 GiB device-to-host copy into `host`, best of 3: GB/s.
fn d2h_rate(ctx: &Arc<CudaContext>, host: *mut u8) -> Res<f64> {
    let stream = ctx.default_stream();
    let dev = stream.alloc_zeros::<u8>(GIB)?;
    let mut best = f64::MAX;
    for _ in 0..3 {
        stream.synchronize()?;
        let t = Instant::now();
        let (src, _sync) = lifecycle_cuda::cudarc::driver::DevicePtr::device_ptr(&dev, &stream);
        // SAFETY: `host` holds at least 1 GiB of registered memory; `dev` 1 GiB on this device.
        unsafe { result::memcpy_dtoh_sync(std::slice::from_raw_parts_mut(host, GIB), src) }?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(GIB as f64 / best / 1e9)
}

fn main() -> Res<()> {
    let cli = Cli::parse();
    let ctx = CudaContext::new(0)?;
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .unwrap_or_else(|_| "unknown".into());
    println!(
        "pin_probe: {} GiB per method, {} CPUs, transparent huge pages: {}",
        cli.gib,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        thp.trim()
    );
    let gb = (cli.gib * GIB) as f64 / 1e9;
    for &threads in &cli.threads {
        let a = by_allocation(&ctx, cli.gib, threads)?;
        let (touch, register, buf, layout) = by_registration(&ctx, cli.gib, threads)?;
        let rate = if threads == cli.threads[0] {
            format!(", d2h into it {:.1} GB/s", d2h_rate(&ctx, buf)?)
        } else {
            String::new()
        };
        unregister(buf, layout, cli.gib);
        println!(
            "  {threads:>2} threads: cuMemHostAlloc {:.2} s ({:.1} GB/s); fault in {:.2} s + \
             register {:.2} s = {:.2} s ({:.1} GB/s){rate}",
            a,
            gb / a,
            touch,
            register,
            touch + register,
            gb / (touch + register)
        );
    }
    Ok(())
}
