//! The pack/unpack kernels of `kernels/pack.cu`: binaries built ahead of
//! time by `kernels/build.py` (NVRTC from PyPI) and embedded here.
//!
//! One load path (`CudaEngine::kernels`): for a device of compute
//! capability X.Y the engine loads the first of these that the driver
//! accepts, each for a reason of its own:
//! 1. the embedded cubin of the highest architecture X.y with y ≤ Y (a
//!    cubin runs on later minors of its major; CUDA's minor-version
//!    compatibility lets a 12.x driver load cubins of a newer 12.x NVRTC).
//!    Why: no JIT and no library beyond the driver on the GPUs that run
//!    vLLM today (sm_80 to sm_120: A100 to B200 and RTX 50).
//! 2. the embedded PTX for compute_70 (stamped PTX ISA 7.0, so drivers
//!    from CUDA 11.0 on can JIT it). Why: the only way to run, with no
//!    library beyond the driver, on a GPU without a cubin here (V100, T4,
//!    a major newer than this build); the driver JITs it once and caches it.
//!
//! Nothing compiles at run time: a GPU older than compute 7.0 (which vLLM
//! does not support either) gets a clear error. NVRTC serves only
//! [`compile_kernels`], CI's check that the source builds for every
//! embedded architecture.

use std::ffi::CString;

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys, Ptx};

use crate::cuda::nvrtc_present;
use crate::error::{Error, Result};

/// The kernels' source.
pub(crate) const SOURCE: &str = include_str!("../../kernels/pack.cu");

/// Hashes of the source the embedded binaries were built from
/// (`kernels/build.py` writes it beside them).
const SOURCE_HASH: &str = include_str!("../../kernels/bin/pack.cu.hash");

/// Embedded cubins, by architecture (`major * 10 + minor`).
const CUBINS: [(u32, &[u8]); 6] = [
    (80, include_bytes!("../../kernels/bin/pack.sm_80.cubin")),
    (86, include_bytes!("../../kernels/bin/pack.sm_86.cubin")),
    (89, include_bytes!("../../kernels/bin/pack.sm_89.cubin")),
    (90, include_bytes!("../../kernels/bin/pack.sm_90.cubin")),
    (100, include_bytes!("../../kernels/bin/pack.sm_100.cubin")),
    (120, include_bytes!("../../kernels/bin/pack.sm_120.cubin")),
];

/// The embedded PTX and the virtual architecture it targets.
const PTX: &str = include_str!("../../kernels/bin/pack.compute_70.ptx");
const PTX_ARCH: u32 = 70;

/// How many descriptors travel by value as a kernel parameter
/// (`PINSHM_INLINE_DESCS` in kernels/pack.cu).
pub(crate) const INLINE_DESCS: usize = 96;

/// Where a loaded kernel binary came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KernelSource {
    /// The embedded cubin for this architecture (`major * 10 + minor`).
    Cubin(u32),
    /// The embedded PTX, JIT-compiled by the driver.
    Ptx(u32),
}

impl std::fmt::Display for KernelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelSource::Cubin(a) => write!(f, "embedded cubin sm_{a}"),
            KernelSource::Ptx(a) => write!(f, "embedded PTX compute_{a} (driver JIT)"),
        }
    }
}

/// The binaries to try for a device of compute capability `cc`, best
/// first (none for a device older than the PTX).
pub(crate) fn candidates(cc: (i32, i32)) -> Vec<KernelSource> {
    let arch = (cc.0.max(0) * 10 + cc.1.max(0)) as u32;
    let mut v = Vec::new();
    if let Some(&(a, _)) = CUBINS
        .iter()
        .filter(|(a, _)| a / 10 == arch / 10 && *a <= arch)
        .max_by_key(|(a, _)| *a)
    {
        v.push(KernelSource::Cubin(a));
    }
    if arch >= PTX_ARCH {
        v.push(KernelSource::Ptx(PTX_ARCH));
    }
    v
}

/// The module image of `src`.
pub(crate) fn image(src: KernelSource) -> Result<Ptx> {
    match src {
        KernelSource::Cubin(a) => CUBINS
            .iter()
            .find(|(x, _)| *x == a)
            .map(|(_, b)| Ptx::from_binary(b.to_vec()))
            .ok_or_else(|| Error::copy(format!("no embedded cubin for sm_{a}"))),
        KernelSource::Ptx(_) => Ok(Ptx::from_src(PTX)),
    }
}

/// Compiles [`SOURCE`] with NVRTC and `arch_opt`; the cubin (`cubin`) or
/// the PTX. Checks that NVRTC is present first: cudarc panics when it
/// calls into a missing libnvrtc.
fn compile(arch_opt: &str, cubin: bool) -> Result<Vec<u8>, String> {
    if !nvrtc_present() {
        return Err("NVRTC (libnvrtc.so) not found".into());
    }
    let src = CString::new(SOURCE).map_err(|e| e.to_string())?;
    let prog = nvrtc::create_program(&src, None).map_err(|e| format!("nvrtcCreateProgram: {e}"))?;
    // SAFETY: `prog` is a live program, destroyed once, below; the option
    // strings live across the call; the size getters write one usize and
    // the getters exactly that many bytes into a buffer of that size.
    unsafe {
        let r = (|| {
            if let Err(e) = nvrtc::compile_program(prog, &[arch_opt, "--std=c++14"]) {
                let log = nvrtc::get_program_log(prog)
                    .map(|l| {
                        let b: Vec<u8> = l.iter().map(|&c| c as u8).collect();
                        String::from_utf8_lossy(&b).into_owned()
                    })
                    .unwrap_or_default();
                return Err(format!(
                    "NVRTC failed on kernels/pack.cu ({arch_opt}): {e}\n{log}"
                ));
            }
            let mut n = 0usize;
            let mut out;
            if cubin {
                nvrtc_sys::nvrtcGetCUBINSize(prog, &mut n)
                    .result()
                    .map_err(|e| format!("nvrtcGetCUBINSize: {e}"))?;
                out = vec![0u8; n];
                nvrtc_sys::nvrtcGetCUBIN(prog, out.as_mut_ptr().cast())
                    .result()
                    .map_err(|e| format!("nvrtcGetCUBIN: {e}"))?;
            } else {
                nvrtc_sys::nvrtcGetPTXSize(prog, &mut n)
                    .result()
                    .map_err(|e| format!("nvrtcGetPTXSize: {e}"))?;
                out = vec![0u8; n];
                nvrtc_sys::nvrtcGetPTX(prog, out.as_mut_ptr().cast())
                    .result()
                    .map_err(|e| format!("nvrtcGetPTX: {e}"))?;
            }
            Ok(out)
        })();
        let _ = nvrtc::destroy_program(prog);
        r
    }
}

/// The real architectures (`major * 10 + minor`) the loaded NVRTC can
/// compile for (`nvrtcGetSupportedArchs`, CUDA 11.2 and later).
fn supported_archs() -> Result<Vec<u32>, String> {
    if !nvrtc_present() {
        return Err("NVRTC (libnvrtc.so) not found".into());
    }
    let mut n: std::ffi::c_int = 0;
    // SAFETY: NVRTC is loaded (checked above); the count getter writes one
    // int, and the list getter exactly that many ints into a buffer of
    // that length.
    let archs = unsafe {
        nvrtc_sys::nvrtcGetNumSupportedArchs(&mut n)
            .result()
            .map_err(|e| format!("nvrtcGetNumSupportedArchs: {e}"))?;
        let mut v: Vec<std::ffi::c_int> = vec![0; usize::try_from(n).unwrap_or(0)];
        if !v.is_empty() {
            nvrtc_sys::nvrtcGetSupportedArchs(v.as_mut_ptr())
                .result()
                .map_err(|e| format!("nvrtcGetSupportedArchs: {e}"))?;
        }
        v
    };
    Ok(archs
        .into_iter()
        .filter_map(|a| u32::try_from(a).ok())
        .collect())
}

/// What [`compile_kernels`] built with the NVRTC it found.
#[derive(Clone, Debug, Default)]
pub struct KernelBuild {
    /// `(binary, bytes)`: `pack.sm_XY.cubin` for every embedded cubin's
    /// architecture this NVRTC supports, and `pack.compute_XY.ptx`.
    pub built: Vec<(String, usize)>,
    /// Embedded binaries this NVRTC cannot build (an NVRTC older or newer
    /// than the architecture: CUDA 13 dropped compute_70, CUDA 11.8 has no
    /// sm_100), with the target used instead for the PTX, if any.
    pub skipped: Vec<String>,
}

/// Compiles `kernels/pack.cu` with NVRTC (no GPU needed), as cubins for
/// every architecture of the embedded cubins that this NVRTC supports,
/// and as PTX for the embedded PTX's compute_70 (or, with an NVRTC that
/// dropped it, its lowest supported architecture). A check that the
/// kernels build wherever NVRTC is installed; `kernels/build.py --check`
/// is the byte-for-byte one, with the NVRTC the binaries were built by.
pub fn compile_kernels() -> Result<KernelBuild> {
    let archs = supported_archs().map_err(Error::copy)?;
    let mut out = KernelBuild::default();
    for (a, _) in CUBINS {
        if !archs.contains(&a) {
            out.skipped
                .push(format!("pack.sm_{a}.cubin (NVRTC has no sm_{a})"));
            continue;
        }
        let n = compile(&format!("--gpu-architecture=sm_{a}"), true).map_err(Error::copy)?;
        out.built.push((format!("pack.sm_{a}.cubin"), n.len()));
    }
    let Some(ptx) = archs.iter().copied().filter(|&a| a >= PTX_ARCH).min() else {
        return Err(Error::copy(format!(
            "this NVRTC supports no architecture from compute_{PTX_ARCH} on: {archs:?}"
        )));
    };
    if ptx != PTX_ARCH {
        out.skipped.push(format!(
            "pack.compute_{PTX_ARCH}.ptx (NVRTC has no compute_{PTX_ARCH}; built compute_{ptx} instead)"
        ));
    }
    let n = compile(&format!("--gpu-architecture=compute_{ptx}"), false).map_err(Error::copy)?;
    out.built.push((format!("pack.compute_{ptx}.ptx"), n.len()));
    Ok(out)
}

/// The embedded binaries: (file name, bytes), and the hash file's text
/// (`sha256 …` and `fnv1a64 …` of the source they were built from).
pub fn kernel_binaries() -> (Vec<(String, usize)>, &'static str) {
    let mut v: Vec<(String, usize)> = CUBINS
        .iter()
        .map(|(a, b)| (format!("pack.sm_{a}.cubin"), b.len()))
        .collect();
    v.push((format!("pack.compute_{PTX_ARCH}.ptx"), PTX.len()));
    (v, SOURCE_HASH)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fnv1a64(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        })
    }

    #[test]
    fn the_embedded_binaries_were_built_from_kernels_pack_cu() {
        let want = format!("fnv1a64 {:016x}", fnv1a64(SOURCE.as_bytes()));
        assert!(
            SOURCE_HASH.lines().any(|l| l == want),
            "kernels/bin is stale: run `python3 kernels/build.py` and commit kernels/bin \
             (kernels/pack.cu hashes to {want}, kernels/bin/pack.cu.hash says {SOURCE_HASH:?})"
        );
        assert!(SOURCE.contains(&format!("#define PINSHM_INLINE_DESCS {INLINE_DESCS}")));
        for (_, b) in CUBINS {
            assert_eq!(&b[..4], b"\x7fELF", "a cubin is an ELF image");
        }
        assert!(PTX.contains(".version 7.0") && PTX.contains(".target sm_70"));
    }

    #[test]
    fn each_device_gets_the_best_binary_it_can_run() {
        use KernelSource::*;
        assert_eq!(candidates((9, 0)), [Cubin(90), Ptx(70)]);
        assert_eq!(candidates((8, 7)), [Cubin(86), Ptx(70)]);
        assert_eq!(candidates((10, 3)), [Cubin(100), Ptx(70)]);
        assert_eq!(candidates((12, 1)), [Cubin(120), Ptx(70)]);
        assert_eq!(candidates((7, 5)), [Ptx(70)], "T4: the PTX");
        assert_eq!(candidates((11, 0)), [Ptx(70)], "no sm_110 cubin");
        assert_eq!(candidates((6, 1)), [], "older than the PTX");
    }
}
