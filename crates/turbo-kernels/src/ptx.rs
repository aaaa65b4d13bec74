//! The kernels' PTX, compiled from `kernels/*.cu` by `cargo xtask kernels` and committed, so
//! machines without nvcc (CI among them) build and embed them. `kernels/ptx/manifest.txt` records
//! the SHA-256 of each source the PTX was made from; a test fails when a source has changed since.

/// One CUDA C++ source file and the PTX built from it.
pub struct KernelModule {
    pub name: &'static str,
    pub ptx: &'static str,
    /// The source, for NVRTC when the driver cannot load the committed PTX.
    pub source: &'static str,
    /// The one compute capability whose devices load this module (architecture-specific
    /// instructions, e.g. Hopper's wgmma); `None`: every device from Ampere on.
    pub only_on: Option<(i32, i32)>,
}

macro_rules! module {
    ($name:literal) => {
        module!($name, None)
    };
    ($name:literal, $only_on:expr) => {
        KernelModule {
            name: $name,
            ptx: include_str!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../kernels/ptx/",
                $name,
                ".ptx"
            )),
            source: include_str!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../kernels/",
                $name,
                ".cu"
            )),
            only_on: $only_on,
        }
    };
}

pub const MODULES: &[KernelModule] = &[
    module!("norm"),
    module!("elementwise"),
    module!("attention"),
    module!("sampling"),
    module!("merge"),
    module!("gemv"),
    module!("scores"),
    module!("comm"),
    module!("attention_sm90a", Some((9, 0))),
];

/// `kernels/ptx/manifest.txt`: `name sha256` per line.
pub const MANIFEST: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/ptx/manifest.txt"
));

/// Shared header included by every kernel source (for NVRTC, which cannot read files).
pub const COMMON_HEADER: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../kernels/common.cuh"
));

/// The SHA-256 of a kernel source together with the shared header, as the manifest records it.
pub fn source_hash(source: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    h.update(COMMON_HEADER.as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The hash the manifest records for `name`'s PTX.
pub fn recorded_hash(name: &str) -> Option<&'static str> {
    MANIFEST.lines().find_map(|l| {
        l.strip_prefix(name)
            .and_then(|r| r.strip_prefix(' '))
            .map(str::trim)
    })
}

/// Whether `module`'s committed PTX was built from its current source.
pub fn is_current(module: &KernelModule) -> bool {
    recorded_hash(module.name) == Some(source_hash(module.source).as_str())
}
