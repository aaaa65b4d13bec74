//! Kernel PTX and the GPU test bundle.

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Portable PTX for every GPU from Ampere on; the driver JIT-compiles it for the device at hand.
const PTX_ARCH: &str = "compute_80";
/// Sources named `*_sm90a.cu` use Hopper-only instructions (wgmma): their PTX targets exactly
/// sm_90, and only such a device loads it.
const SM90A_SUFFIX: &str = "_sm90a";

/// The PTX target of a kernel source.
fn ptx_arch(name: &str) -> &'static str {
    if name.ends_with(SM90A_SUFFIX) {
        "compute_90a"
    } else {
        PTX_ARCH
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn nvcc() -> PathBuf {
    if let Some(p) = std::env::var_os("NVCC") {
        return p.into();
    }
    let on_path = Command::new("nvcc").arg("--version").output().is_ok();
    if on_path {
        "nvcc".into()
    } else {
        "/usr/local/cuda/bin/nvcc".into()
    }
}

/// SHA-256 of a kernel source together with the shared header (and a variant's `MACRO=value`),
/// as recorded in the manifest.
pub fn source_hash(source: &str, header: &str, variant: Option<&str>) -> String {
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    h.update(header.as_bytes());
    if let Some(v) = variant {
        h.update(v.as_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The macro and values of a source's `// kernel-variants MACRO: A B ...` line.
fn variants(source: &str) -> Option<(String, Vec<String>)> {
    let line = source
        .lines()
        .find_map(|l| l.trim().strip_prefix("// kernel-variants "))?;
    let (mac, values) = line.split_once(':')?;
    Some((
        mac.trim().to_string(),
        values.split_whitespace().map(str::to_string).collect(),
    ))
}

pub fn compile() -> Result<()> {
    let dir = root().join("kernels");
    let out = dir.join("ptx");
    std::fs::create_dir_all(&out)?;
    let header = std::fs::read_to_string(dir.join("common.cuh"))?;
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    let nvcc = nvcc();
    let mut manifest = String::new();
    for src in &sources {
        let stem = src.file_stem().unwrap().to_string_lossy().to_string();
        let text = std::fs::read_to_string(src)?;
        // A source may be built several times, once per value of a macro it names on a line
        // `// kernel-variants MACRO: A B ...`, into `<stem>_<value in lower case>.ptx`.
        let builds: Vec<(String, Option<(String, String)>)> = match variants(&text) {
            Some((mac, values)) => values
                .into_iter()
                .map(|v| {
                    let name = format!("{stem}_{}", v.to_lowercase());
                    (name, Some((mac.clone(), v)))
                })
                .collect(),
            None => vec![(stem.clone(), None)],
        };
        for (name, variant) in builds {
            let ptx = out.join(format!("{name}.ptx"));
            let mut cmd = Command::new(&nvcc);
            cmd.args([
                "-ptx",
                &format!("-arch={}", ptx_arch(&name)),
                "-O3",
                "-std=c++17",
                "-lineinfo",
            ]);
            if let Some((mac, value)) = &variant {
                cmd.arg(format!("-D{mac}={value}"));
            }
            let status = cmd
                .arg("-I")
                .arg(&dir)
                .arg("-o")
                .arg(&ptx)
                .arg(src)
                .status()
                .with_context(|| format!("cannot run {} (set NVCC)", nvcc.display()))?;
            if !status.success() {
                bail!("nvcc failed on {} ({name})", src.display());
            }
            let tag = variant.map(|(m, v)| format!("{m}={v}"));
            manifest.push_str(&format!(
                "{name} {}\n",
                source_hash(&text, &header, tag.as_deref())
            ));
            println!("{} -> {}", src.display(), ptx.display());
        }
    }
    std::fs::write(out.join("manifest.txt"), manifest)?;
    Ok(())
}

/// Test binaries that exercise the GPU, and the benches.
const GPU_TEST_PACKAGES: &[&str] = &["turbo-kernels"];

pub fn gpu_bundle() -> Result<()> {
    let root = root();
    let bundle = root.join(".gpu");
    std::fs::create_dir_all(&bundle)?;
    let mut names = Vec::new();
    for (kind, flag) in [("test", "--tests"), ("bench", "--benches")] {
        let mut cmd = Command::new(env!("CARGO"));
        cmd.current_dir(&root)
            .args(["build", "--release", flag, "--message-format=json"]);
        for p in GPU_TEST_PACKAGES {
            cmd.args(["-p", p]);
        }
        let output = cmd.output().context("cargo build")?;
        if !output.status.success() {
            bail!(
                "cargo build {flag} failed:\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let Some(exe) = msg.get("executable").and_then(|e| e.as_str()) else {
                continue;
            };
            let is_test = msg.pointer("/profile/test").and_then(|t| t.as_bool()) == Some(true);
            let target_kind = msg
                .pointer("/target/kind/0")
                .and_then(|k| k.as_str())
                .unwrap_or("");
            if kind == "test" && !is_test || kind == "bench" && target_kind != "bench" {
                continue;
            }
            let name = format!(
                "{kind}-{}",
                msg.pointer("/target/name")
                    .and_then(|n| n.as_str())
                    .unwrap_or("x")
            );
            let dst = bundle.join(&name);
            std::fs::copy(exe, &dst)?;
            let _ = Command::new("strip").arg(&dst).status();
            names.push((kind, name));
        }
    }
    // The CLI, for end-to-end runs and `turbo bench` on the GPU.
    let status = Command::new(env!("CARGO"))
        .current_dir(&root)
        .args(["build", "--release", "-p", "turbo-cli", "--bin", "turbo"])
        .status()?;
    if !status.success() {
        bail!("building turbo failed");
    }
    std::fs::copy(root.join("target/release/turbo"), bundle.join("turbo"))?;
    let _ = Command::new("strip").arg(bundle.join("turbo")).status();
    // The random-weight GGUF writer for real-size benchmarks (the tree's, which writes the
    // quantized mixes), and the tokenizer it takes from the shared tools beside the tree.
    std::fs::copy(
        root.join("benches/random_llama_gguf.py"),
        bundle.join("random_llama_gguf.py"),
    )?;
    let tokenizer = root.join("../shared/tools/smollm2-tokenizer.json.gz");
    if tokenizer.is_file() {
        std::fs::copy(&tokenizer, bundle.join("smollm2-tokenizer.json.gz"))?;
    }
    let mut script = String::from(
        "#!/usr/bin/env bash\n# Runs every GPU test and bench binary; run from the repository root.\n\
         set -u\nexport LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}\nsummary=\"\"\n",
    );
    for (kind, name) in &names {
        let args = if *kind == "test" {
            "--test-threads=1 --nocapture"
        } else {
            "--bench"
        };
        script.push_str(&format!(
            "echo '=== {name}'\n.gpu/{name} {args} 2>&1 | tee /tmp/{name}.log\nsummary+=\"{name}: $(grep -E '^test result' /tmp/{name}.log | tail -1)\\n\"\n"
        ));
    }
    script.push_str("echo; echo '=== summary'; printf \"$summary\"\n");
    std::fs::write(bundle.join("run.sh"), script)?;
    println!("bundle in {} ({} binaries)", bundle.display(), names.len());
    Ok(())
}
