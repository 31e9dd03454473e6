#!/usr/bin/env python3
"""Builds the kernels of kernels/pack.cu ahead of time, into kernels/bin/.

Needs only python3 and NVRTC (libnvrtc.so.12; no GPU, no CUDA toolkit),
e.g. from PyPI:  pip download nvidia-cuda-nvrtc-cu12==12.9.86  (.ci/run
fetches it into ~/.cache/pinshm-nvrtc). Writes:

  kernels/bin/pack.sm_XY.cubin   SASS for each architecture of ARCHS
  kernels/bin/pack.compute_70.ptx PTX for older or newer GPUs (JIT by the
                                 driver), its ISA version lowered (see below)
  kernels/bin/pack.cu.hash       hashes of the source these were built from

src/copy/kernels.rs embeds them with include_bytes!; a test checks the
FNV-1a hash against kernels/pack.cu, and `build.py --check` (run by
.ci/run) checks the SHA-256 and, with NVRTC, rebuilds and compares bytes.

Usage: kernels/build.py [--check] [--nvrtc PATH/libnvrtc.so.12]
"""
import ctypes
import hashlib
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "pack.cu")
OUT = os.path.join(HERE, "bin")
# Cubins: A100, A10/A40/RTX 30xx, L4/L40/RTX 40xx, H100/H200, B200, RTX 50xx.
# A cubin also runs on later minors of its major (sm_80 on sm_87, sm_100 on
# sm_103, sm_120 on sm_121). NVRTC 12.9 supports them all.
ARCHS = [80, 86, 89, 90, 100, 120]
PTX_ARCH = 70
# NVRTC 12.9 stamps its PTX ".version 8.8", which drivers older than 12.9
# refuse to JIT (CUDA_ERROR_UNSUPPORTED_PTX_VERSION). These kernels use
# nothing newer than PTX ISA 7.0 (CUDA 11.0, sm_70), so the stamp is
# lowered to that. (Checked with ptxas where one is installed:
# `ptxas -arch=sm_70 kernels/bin/pack.compute_70.ptx`.)
PTX_VERSION = "7.0"


def fnv1a64(data):
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def hash_text(src):
    return "sha256 %s\nfnv1a64 %016x\n" % (hashlib.sha256(src).hexdigest(), fnv1a64(src))


def find_nvrtc(explicit):
    cands = [explicit] if explicit else []
    cands += [os.path.join(d, "libnvrtc.so.12")
              for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    cands.append(os.path.expanduser("~/.cache/pinshm-nvrtc/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"))
    cands.append("libnvrtc.so.12")
    for c in cands:
        try:
            return ctypes.CDLL(c)
        except OSError:
            continue
    return None


def compile_one(lib, src, opt, want_cubin):
    prog = ctypes.c_void_p()
    check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"pack.cu", 0, None, None), "create")
    opts = (ctypes.c_char_p * 2)(opt, b"--std=c++14")
    rc = lib.nvrtcCompileProgram(prog, 2, opts)
    if rc != 0:
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        sys.exit("NVRTC failed on %s (%s):\n%s" % (SRC, opt.decode(), log.value.decode()))
    n = ctypes.c_size_t()
    if want_cubin:
        check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(n)), "cubin size")
        buf = ctypes.create_string_buffer(n.value)
        check(lib, lib.nvrtcGetCUBIN(prog, buf), "cubin")
        out = buf.raw[: n.value]
    else:
        check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(n)), "ptx size")
        buf = ctypes.create_string_buffer(n.value)
        check(lib, lib.nvrtcGetPTX(prog, buf), "ptx")
        out = buf.raw[: n.value].rstrip(b"\0")
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return out


def check(lib, rc, what):
    if rc != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        sys.exit("NVRTC %s: %s" % (what, lib.nvrtcGetErrorString(rc).decode()))


def build(lib, src):
    """{file name: bytes} for everything in kernels/bin."""
    out = {}
    for a in ARCHS:
        out["pack.sm_%d.cubin" % a] = compile_one(lib, src, b"--gpu-architecture=sm_%d" % a, True)
    ptx = compile_one(lib, src, b"--gpu-architecture=compute_%d" % PTX_ARCH, False)
    ptx, n = re.subn(rb"^\.version \d+\.\d+$", b".version " + PTX_VERSION.encode(), ptx, count=1, flags=re.M)
    if n != 1:
        sys.exit("no .version line in the PTX")
    out["pack.compute_%d.ptx" % PTX_ARCH] = ptx + b"\n"
    out["pack.cu.hash"] = hash_text(src).encode()
    return out


def main():
    args = sys.argv[1:]
    check_only = "--check" in args
    explicit = args[args.index("--nvrtc") + 1] if "--nvrtc" in args else None
    src = open(SRC, "rb").read()
    if check_only:
        stored = open(os.path.join(OUT, "pack.cu.hash")).read()
        if stored != hash_text(src):
            sys.exit("kernels/bin is stale: kernels/pack.cu changed since kernels/build.py ran "
                     "(run python3 kernels/build.py and commit kernels/bin)")
        lib = find_nvrtc(explicit)
        if lib is None:
            print("kernels/bin matches kernels/pack.cu (hash; no NVRTC here to rebuild and compare)")
            return
        for name, data in build(lib, src).items():
            if open(os.path.join(OUT, name), "rb").read() != data:
                sys.exit("kernels/bin/%s differs from a fresh NVRTC build of kernels/pack.cu" % name)
        print("kernels/bin matches kernels/pack.cu (hash, and a fresh NVRTC build byte for byte)")
        return
    lib = find_nvrtc(explicit)
    if lib is None:
        sys.exit("libnvrtc.so.12 not found: pip download nvidia-cuda-nvrtc-cu12==12.9.86, "
                 "unzip it and pass --nvrtc .../nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
    os.makedirs(OUT, exist_ok=True)
    total = 0
    for name, data in build(lib, src).items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
        total += len(data)
        print("%-26s %7d bytes" % (name, len(data)))
    print("kernels/bin: %d bytes" % total)


if __name__ == "__main__":
    main()
