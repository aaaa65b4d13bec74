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
    /// The source file (`kernels/<file>.cu`): the module's name, or the file a variant was built from.
    pub file: &'static str,
    /// A variant's macro and value: the source compiled with `-D<macro>=<value>`. Variants load
    /// at their first use, not with the rest ([`CudaDevice::load_modules`]), so that a process
    /// compiles only the ones its weights need.
    ///
    /// [`CudaDevice::load_modules`]: crate::device::CudaDevice::load_modules
    pub variant: Option<(&'static str, &'static str)>,
}

impl KernelModule {
    /// The source with its variant's macro defined first (as `-D` would define it).
    pub fn source_with_variant(&self, source: &str) -> String {
        match self.variant {
            Some((name, value)) => format!("#define {name} {value}\n{source}"),
            None => source.to_string(),
        }
    }
}

/// A module built from `kernels/$file.cu` into `kernels/ptx/$name.ptx`.
macro_rules! kernel_module {
    ($name:literal, $file:literal, $only_on:expr, $variant:expr) => {
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
                $file,
                ".cu"
            )),
            only_on: $only_on,
            file: $file,
            variant: $variant,
        }
    };
}

macro_rules! module {
    ($name:literal) => {
        kernel_module!($name, $name, None, None)
    };
    ($name:literal, $only_on:expr) => {
        kernel_module!($name, $name, $only_on, None)
    };
}

/// A variant module `$name` of `kernels/$file.cu`, compiled with `-D$macro=$value`.
macro_rules! variant {
    ($name:literal, $file:literal, $macro:literal, $value:literal) => {
        kernel_module!($name, $file, None, Some(($macro, $value)))
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
    module!("gemv_sm90a", Some((9, 0))),
    variant!("quant_q4_0", "quant", "QUANT_TYPE", "Q4_0"),
    variant!("quant_q4_1", "quant", "QUANT_TYPE", "Q4_1"),
    variant!("quant_q5_0", "quant", "QUANT_TYPE", "Q5_0"),
    variant!("quant_q5_1", "quant", "QUANT_TYPE", "Q5_1"),
    variant!("quant_q8_0", "quant", "QUANT_TYPE", "Q8_0"),
    variant!("quant_q4_k", "quant", "QUANT_TYPE", "Q4_K"),
    variant!("quant_q5_k", "quant", "QUANT_TYPE", "Q5_K"),
    variant!("quant_q6_k", "quant", "QUANT_TYPE", "Q6_K"),
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

/// The SHA-256 of a module's source together with the shared header (and its variant's
/// `macro=value`), as the manifest records it.
pub fn source_hash(module: &KernelModule) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(module.source.as_bytes());
    h.update(COMMON_HEADER.as_bytes());
    if let Some((name, value)) = module.variant {
        h.update(format!("{name}={value}").as_bytes());
    }
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
    recorded_hash(module.name) == Some(source_hash(module).as_str())
}
