//! Ctrl-C in the commands that run the model in the foreground: it stops the work in hand
//! (a reply, a generation, a requests file) and keeps what was done, instead of killing the
//! process with it.

use anyhow::Context;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The command was stopped by Ctrl-C; it exits with 130, as shells report an interrupted one.
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for Interrupted {}

/// Exit code of a command stopped by Ctrl-C (128 + SIGINT).
pub const EXIT_CODE: u8 = 130;

/// Calls `on_interrupt` on every Ctrl-C with how many there have been (1 for the first), on a
/// thread of its own. Once per process.
pub fn on_ctrl_c(on_interrupt: impl Fn(usize) + Send + 'static) -> anyhow::Result<()> {
    let hits = AtomicUsize::new(0);
    ctrlc::set_handler(move || on_interrupt(hits.fetch_add(1, Ordering::SeqCst) + 1))
        .context("cannot handle Ctrl-C")
}

/// Ctrl-C for a command that waits on requests: the first cancels them through `cancel` (they
/// end as cancelled, with what they generated), a second one exits at once.
pub fn cancel_on_ctrl_c(cancel: impl Fn() + Send + 'static) -> anyhow::Result<()> {
    on_ctrl_c(move |hits| {
        if hits == 1 {
            eprintln!("\n[interrupted: stopping; Ctrl-C again to quit at once]");
            cancel();
        } else {
            std::process::exit(EXIT_CODE.into());
        }
    })
}
