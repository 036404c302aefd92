#!/usr/bin/env python3
"""Compiles every kernel file of kernels/ with NVRTC, as the backends do at run time, and
assembles the PTX with ptxas where one is found: syntax, inline PTX and register use checked on
a machine without a GPU.

    pip install --target /tmp/cu nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12
    python3 scripts/check-kernels.py --cuda /tmp/cu/nvidia

    # CUDA 13's wheels (nvidia/cu13/{lib,bin}), with cuobjdump to read the machine code:
    pip install --target /tmp/cu nvidia-cuda-{nvrtc,nvcc,cuobjdump,nvdisasm}
    python3 scripts/check-kernels.py --cuda /tmp/cu/nvidia --sass /tmp/sass

Each file is compiled for sm_90 and, for the kernels of Hopper's warpgroup instructions, for
sm_90a (the W8A8 file; see `KernelSet::arch_specific`), with the options the backends compile it
with (exact math where its `KernelSet` is `exact()`). ptxas prints each kernel's registers and
spills with --verbose; with --sass DIR each file's machine code (cuobjdump -sass) goes to
DIR/FILE.ARCH.sass, where one can read, say, whether a loop's loads are requested together.
Exit status 1 if any file fails.
"""

import argparse
import ctypes
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
# files also compiled for the architecture-specific target (their warpgroup kernels exist only
# there)
ARCH_SPECIFIC = {"w8a8_mma.cu"}
# files whose kernel sets are `exact()` (backends/cuda/src/modules.rs: no contracted
# multiply-adds, IEEE division and square root, denormals kept)
EXACT = {"decoder.cu", "fp8_quantise.cu", "fsdp_update.cu"}
EXACT_OPTIONS = ["--fmad=false", "--prec-div=true", "--prec-sqrt=true", "--ftz=false"]


def nvrtc(lib, source, name, arch):
    """The PTX of `source` for `arch`, or raises with NVRTC's log."""
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source, name.encode(), 0, None, None)
    if rc != 0:
        raise RuntimeError(f"nvrtcCreateProgram returned {rc}")
    try:
        opts = [f"--gpu-architecture={arch}".encode()]
        if name in EXACT:
            opts += [o.encode() for o in EXACT_OPTIONS]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            raise RuntimeError(log.value.decode(errors="replace"))
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.value
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cuda",
        type=pathlib.Path,
        required=True,
        help="folder holding cuda_nvrtc/lib/libnvrtc.so.* (and cuda_nvcc/bin/ptxas), as the "
        "nvidia-cuda-*-cu12 wheels install it, or cu13/lib and cu13/bin, as CUDA 13's do",
    )
    ap.add_argument("--verbose", action="store_true", help="print ptxas's register report")
    ap.add_argument(
        "--sass",
        type=pathlib.Path,
        help="write each file's machine code (cuobjdump -sass of what ptxas assembled) here",
    )
    args = ap.parse_args()
    libs = sorted((args.cuda / "cuda_nvrtc" / "lib").glob("libnvrtc.so.*")) + sorted(
        (args.cuda / "cu13" / "lib").glob("libnvrtc.so.*")
    )
    if not libs:
        sys.exit(f"no libnvrtc.so.* under {args.cuda}/cuda_nvrtc/lib or {args.cuda}/cu13/lib")
    lib = ctypes.CDLL(str(libs[0]))
    def tool(name, wheel):
        """`name` from the cu12 wheel's folder or CUDA 13's, or None."""
        found = [args.cuda / wheel / "bin" / name, args.cuda / "cu13" / "bin" / name]
        return next((p for p in found if p.is_file()), None)

    ptxas = tool("ptxas", "cuda_nvcc")
    cuobjdump = tool("cuobjdump", "cuda_cuobjdump")
    if args.sass is not None:
        if ptxas is None or cuobjdump is None:
            sys.exit(f"--sass needs ptxas and cuobjdump under {args.cuda}")
        args.sass.mkdir(parents=True, exist_ok=True)
    failed = 0
    for cu in sorted((ROOT / "kernels").glob("*.cu")):
        source = cu.read_bytes()
        archs = ["sm_90"] + (["sm_90a"] if cu.name in ARCH_SPECIFIC else [])
        for arch in archs:
            try:
                ptx = nvrtc(lib, source, cu.name, arch)
            except RuntimeError as e:
                print(f"FAIL {cu.name} ({arch}): {e}")
                failed += 1
                continue
            note = "compiled"
            if ptxas is not None:
                with tempfile.TemporaryDirectory() as tmp:
                    p = pathlib.Path(tmp) / "k.ptx"
                    p.write_bytes(ptx)
                    run = subprocess.run(
                        [str(ptxas), f"-arch={arch}", "-v", str(p), "-o", str(p) + ".cubin"],
                        capture_output=True,
                        text=True,
                    )
                    if run.returncode == 0 and args.sass is not None:
                        sass = subprocess.run(
                            [str(cuobjdump), "-sass", str(p) + ".cubin"],
                            capture_output=True,
                            text=True,
                            # cuobjdump runs nvdisasm, which the same wheels put beside it
                            env={**os.environ, "PATH": f"{cuobjdump.parent}:{os.environ.get('PATH', '')}"},
                        )
                        if sass.returncode != 0:
                            print(f"FAIL {cu.name} ({arch}): cuobjdump: {sass.stderr.strip()}")
                            failed += 1
                            continue
                        (args.sass / f"{cu.name}.{arch}.sass").write_text(sass.stdout)
                if run.returncode != 0:
                    print(f"FAIL {cu.name} ({arch}): ptxas: {run.stderr.strip()}")
                    failed += 1
                    continue
                spills = [l for l in run.stderr.splitlines() if "spill" in l and " 0 bytes spill stores" not in l]
                note = "compiled and assembled" + (f"; {len(spills)} kernels spill" if spills else "")
                if args.verbose:
                    print(run.stderr)
            print(f"ok   {cu.name} ({arch}): {note}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
