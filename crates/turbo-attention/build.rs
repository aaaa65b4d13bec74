//! Sets `cfg(avx512_intrinsics)` when the compiler has stable AVX-512 intrinsics (Rust 1.89 and
//! later). The crate's minimum Rust is older; without them the tiled attention kernels use AVX2
//! on AVX-512 CPUs too.

use std::process::Command;

fn main() {
    println!("cargo:rustc-check-cfg=cfg(avx512_intrinsics)");
    println!("cargo:rerun-if-changed=build.rs");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let Ok(output) = Command::new(rustc).arg("--version").output() else {
        return;
    };
    // "rustc 1.89.0 (29483883e 2025-08-04)"
    let version = String::from_utf8_lossy(&output.stdout);
    let minor = version
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.split('.').nth(1))
        .and_then(|m| m.parse::<u32>().ok());
    if minor.is_some_and(|m| m >= 89) {
        println!("cargo:rustc-cfg=avx512_intrinsics");
    }
}
