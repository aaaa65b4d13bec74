//! CPU-side checks of the kernel build: the committed PTX was made from the current sources, and
//! a machine without CUDA gets a clear "no device" outcome instead of a crash.

use sha2::{Digest, Sha256};
use turbo_kernels::ptx::{COMMON_HEADER, MANIFEST, MODULES};

#[test]
fn committed_ptx_matches_the_kernel_sources() {
    for module in MODULES {
        let mut h = Sha256::new();
        h.update(module.source.as_bytes());
        h.update(COMMON_HEADER.as_bytes());
        let hash: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        let recorded = MANIFEST
            .lines()
            .find_map(|l| {
                l.strip_prefix(module.name)
                    .and_then(|r| r.strip_prefix(' '))
            })
            .unwrap_or_else(|| panic!("kernels/ptx/manifest.txt has no entry for {}", module.name));
        assert_eq!(
            recorded.trim(),
            hash,
            "kernels/{}.cu changed since its PTX was built: run `cargo xtask kernels`",
            module.name
        );
        assert!(
            module.ptx.contains(".entry"),
            "{}.ptx holds no kernels",
            module.name
        );
    }
}

#[test]
fn without_a_gpu_the_backend_reports_no_device() {
    if turbo_kernels::cuda_available() {
        eprintln!("skipping: a CUDA device is present");
        return;
    }
    let err = turbo_kernels::CudaBackend::new(0)
        .err()
        .expect("no device, no backend");
    assert!(err.to_string().contains("no CUDA device"), "{err}");
}
