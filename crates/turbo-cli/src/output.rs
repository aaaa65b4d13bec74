//! Writing results: stdout and stderr may be a closed pipe (`turbo generate | head -c 5`) or a
//! full disk (`> /dev/full`), which `println!` and `eprintln!` turn into panics.
//!
//! - [`outln!`] and [`out!`] write to stdout and return the error with context, for `?`;
//!   [`crate::exit_code`] ends a command whose reader went away quietly, and reports any other
//!   write error (a full disk) as one line.
//! - `eprintln!` is shadowed, for the whole crate, by one that drops write errors: a diagnostic
//!   that cannot be shown is no reason to stop.

/// `writeln!` to stdout, with the error as `anyhow::Error` naming stdout.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        use anyhow::Context as _;
        writeln!(std::io::stdout().lock(), $($arg)*).context("cannot write to standard output")
    }};
}

/// `write!` to stdout and flush, with the error as `anyhow::Error` naming stdout.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        use anyhow::Context as _;
        let mut stdout = std::io::stdout().lock();
        write!(stdout, $($arg)*)
            .and_then(|_| stdout.flush())
            .context("cannot write to standard output")
    }};
}

/// `eprintln!` that ignores a stderr it cannot write to instead of panicking.
macro_rules! eprintln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

/// Whether `e` is, or was caused by, a write to a reader that went away (a closed pipe).
pub fn is_closed_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Checks before a long run that the file `flag` names can be written when the run ends (its
/// directory exists, it is not a directory, it can be opened for writing), so that a mistyped
/// path does not lose the run's results. A file that did not exist is not left behind.
pub fn check_writable(flag: &str, path: &std::path::Path) -> anyhow::Result<()> {
    use anyhow::{ensure, Context as _};
    let shown = path.display();
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    ensure!(
        parent.is_dir(),
        "{flag} {shown}: directory {} does not exist",
        parent.display()
    );
    ensure!(!path.is_dir(), "{flag} {shown} is a directory");
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .with_context(|| format!("{flag} {shown} cannot be written"))?;
    if !existed {
        // Best effort: the file is written for good after the run.
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}
