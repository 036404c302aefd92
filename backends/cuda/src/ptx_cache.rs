//! Compiled PTX kept on disk between processes, so that NVRTC compiles each kernel set once per
//! machine rather than once per process (the decoder's kernels take it seconds each; the driver
//! keeps its own cache of the machine code it makes from the PTX). A file is named by the set
//! and a hash of everything that shapes its PTX: the source, the compile options (architecture,
//! arithmetic, include folder) and NVRTC's version. The cache is best effort: a file that cannot
//! be read or written is compiled again, never an error.
//!
//! Where: the folder `LIFECYCLE_KERNEL_CACHE` names; unset or empty, no cache (opt-in until the
//! cache has run on the GPU machines).

use std::path::{Path, PathBuf};

use cudarc::nvrtc::{CompileOptions, Ptx};

/// The cache folder of this process's environment (`None`: no cache).
pub(crate) fn cache_dir() -> Option<PathBuf> {
    dir_from(std::env::var_os("LIFECYCLE_KERNEL_CACHE"))
}

fn dir_from(own: Option<std::ffi::OsString>) -> Option<PathBuf> {
    own.filter(|d| !d.is_empty()).map(PathBuf::from)
}

/// The file of kernel set `name` (`source`) compiled with `opts` by NVRTC `version` in `dir`.
pub(crate) fn file_of(
    dir: &Path,
    name: &str,
    source: &str,
    opts: &CompileOptions,
    version: (i32, i32),
) -> PathBuf {
    let mut h = Fnv::default();
    h.write(source.as_bytes());
    h.write(format!("{opts:?}").as_bytes());
    h.write(format!("nvrtc {}.{}", version.0, version.1).as_bytes());
    let stem: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    dir.join(format!("{stem}-{:016x}.ptx", h.0))
}

/// The PTX kept at `path`, if a complete one is there.
pub(crate) fn read(path: &Path) -> Option<Ptx> {
    let text = std::fs::read_to_string(path).ok()?;
    // a PTX module states its version first and is never empty; anything else is not ours
    (text.contains(".version") && text.contains(".target")).then(|| Ptx::from_src(text))
}

/// The text of PTX NVRTC compiled (`None` for PTX from elsewhere).
pub(crate) fn text_of(ptx: &Ptx) -> Option<&[u8]> {
    let bytes = ptx.as_bytes()?;
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    Some(&bytes[..end])
}

/// Keeps the PTX `text` at `path` (written beside it, then renamed: a reader sees all of it or
/// nothing); a failure leaves nothing behind and is not reported.
pub(crate) fn write(path: &Path, text: &[u8]) {
    let Some(dir) = path.parent() else {
        return;
    };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = path.with_extension(format!("ptx.{}.tmp", std::process::id()));
    if std::fs::write(&tmp, text).is_err() || std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// NVRTC's version (the library must be present: [`crate::nvrtc_present`]).
pub(crate) fn nvrtc_version() -> Option<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the caller checked that NVRTC loads; the call writes two ints through the
    // pointers, which point at live locals.
    let rc = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (rc == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
}

/// 64-bit FNV-1a: a stable name for the key (std's hasher may change between releases).
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
        // a separator, so that ("ab", "c") and ("a", "bc") differ
        self.0 ^= 0xff;
        self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_folder_is_the_one_the_environment_names() {
        let os = |s: &str| Some(std::ffi::OsString::from(s));
        assert_eq!(dir_from(os("/k")), Some(PathBuf::from("/k")));
        assert_eq!(dir_from(os("")), None);
        assert_eq!(dir_from(None), None);
    }

    #[test]
    fn a_file_is_named_by_everything_that_shapes_its_ptx() {
        let dir = Path::new("/c");
        let opts = |arch: &str| CompileOptions {
            options: vec![format!("--gpu-architecture={arch}")],
            ..Default::default()
        };
        let base = file_of(dir, "my set", "src", &opts("sm_90"), (13, 0));
        assert!(base.starts_with(dir));
        assert!(base.to_string_lossy().contains("my_set-"), "{base:?}");
        assert_eq!(base, file_of(dir, "my set", "src", &opts("sm_90"), (13, 0)));
        for other in [
            file_of(dir, "my set", "src2", &opts("sm_90"), (13, 0)),
            file_of(dir, "my set", "src", &opts("sm_90a"), (13, 0)),
            file_of(dir, "my set", "src", &opts("sm_90"), (13, 1)),
        ] {
            assert_ne!(base, other);
        }
    }

    #[test]
    fn what_is_written_is_read_and_only_a_whole_ptx_file() {
        let dir = std::env::temp_dir().join(format!("lifecycle-ptx-cache-{}", std::process::id()));
        let path = dir.join("deeper").join("set-0.ptx");
        assert!(read(&path).is_none());
        let text = "//\n.version 8.8\n.target sm_90\n.address_size 64\n";
        write(&path, text.as_bytes());
        assert_eq!(read(&path).map(|p| p.to_src()).as_deref(), Some(text));
        // nothing left beside it
        let names: Vec<_> = std::fs::read_dir(dir.join("deeper")).unwrap().collect();
        assert_eq!(names.len(), 1);
        std::fs::write(&path, "").unwrap();
        assert!(read(&path).is_none());
        std::fs::write(&path, "not ptx").unwrap();
        assert!(read(&path).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
