//! Files for the targets that load from disk: each case gets a directory of its own, removed
//! when the case ends, so that no case reads (or maps) another's files.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Where case directories go: `$TURBO_FUZZ_SCRATCH` (the runner sets it to a directory it
/// removes for its workers), else the directory given to [`set_root`], else a temporary
/// directory made for the process and left behind (libFuzzer's processes).
pub const SCRATCH_ENV: &str = "TURBO_FUZZ_SCRATCH";

static ROOT: OnceLock<PathBuf> = OnceLock::new();

/// Puts case directories under `dir` (which the caller removes), unless `$TURBO_FUZZ_SCRATCH`
/// says otherwise or a case has run already.
pub fn set_root(dir: &Path) {
    if std::env::var_os(SCRATCH_ENV).is_none() {
        let _ = ROOT.set(dir.to_path_buf());
    }
}

fn root() -> &'static Path {
    ROOT.get_or_init(|| match std::env::var_os(SCRATCH_ENV) {
        Some(dir) => PathBuf::from(dir),
        None => tempfile::Builder::new()
            .prefix("turbo-fuzz-")
            .tempdir()
            .expect("a temporary directory")
            .keep(),
    })
}

/// A directory for one case, removed on drop.
pub struct CaseDir {
    path: PathBuf,
}

impl CaseDir {
    pub fn new() -> CaseDir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = root().join(format!("case-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
        CaseDir { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `name` in the directory; `name` is one of the targets' fixed file names.
    pub fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let path = self.path.join(name);
        std::fs::write(&path, bytes)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        path
    }
}

impl Default for CaseDir {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for CaseDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
