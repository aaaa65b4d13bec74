//! CPU-side checks of the kernel build: the committed PTX was made from the current sources, and
//! a machine without CUDA gets a clear "no device" outcome instead of a crash.

use turbo_kernels::ptx::{is_current, recorded_hash, source_hash, MODULES};

#[test]
fn committed_ptx_matches_the_kernel_sources() {
    for module in MODULES {
        let recorded = recorded_hash(module.name)
            .unwrap_or_else(|| panic!("kernels/ptx/manifest.txt has no entry for {}", module.name));
        assert_eq!(
            recorded,
            source_hash(module),
            "kernels/{}.cu changed since the PTX of {} was built: run `cargo xtask kernels`",
            module.file,
            module.name
        );
        assert!(is_current(module));
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
