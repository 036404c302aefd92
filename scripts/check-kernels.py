#!/usr/bin/env python3
"""Compiles every kernel file of kernels/ with NVRTC, as the backends do at run time, and
assembles the PTX with ptxas where one is found: syntax, inline PTX and register use checked on
a machine without a GPU.

    pip install --target /tmp/cu nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12
    python3 scripts/check-kernels.py --cuda /tmp/cu/nvidia

Each file is compiled for sm_90 and, for the kernels of Hopper's warpgroup instructions, for
sm_90a (the W8A8 file; see `KernelSet::arch_specific`). ptxas prints each kernel's registers and
spills with --verbose. Exit status 1 if any file fails.
"""

import argparse
import ctypes
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
# files also compiled for the architecture-specific target (their warpgroup kernels exist only
# there)
ARCH_SPECIFIC = {"w8a8_mma.cu"}


def nvrtc(lib, source, name, arch):
    """The PTX of `source` for `arch`, or raises with NVRTC's log."""
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source, name.encode(), 0, None, None)
    if rc != 0:
        raise RuntimeError(f"nvrtcCreateProgram returned {rc}")
    try:
        opts = [f"--gpu-architecture={arch}".encode()]
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
        "nvidia-cuda-* wheels install it",
    )
    ap.add_argument("--verbose", action="store_true", help="print ptxas's register report")
    args = ap.parse_args()
    libs = sorted((args.cuda / "cuda_nvrtc" / "lib").glob("libnvrtc.so.*"))
    if not libs:
        sys.exit(f"no libnvrtc.so.* under {args.cuda / 'cuda_nvrtc' / 'lib'}")
    lib = ctypes.CDLL(str(libs[0]))
    ptxas = args.cuda / "cuda_nvcc" / "bin" / "ptxas"
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
            if ptxas.is_file():
                with tempfile.TemporaryDirectory() as tmp:
                    p = pathlib.Path(tmp) / "k.ptx"
                    p.write_bytes(ptx)
                    run = subprocess.run(
                        [str(ptxas), f"-arch={arch}", "-v", str(p), "-o", str(p) + ".cubin"],
                        capture_output=True,
                        text=True,
                    )
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
