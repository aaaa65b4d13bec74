//! Ctrl-C in the commands that run the model in the foreground: it stops the work in hand
//! (a reply, a generation, a requests file) and keeps what was done, instead of killing the
//! process with it. The handler is installed when the command starts (before the model loads),
//! so that Ctrl-C works from the first moment, even where the shell started the command with
//! SIGINT ignored (a background job); until a command says what Ctrl-C means, it exits at once.

use anyhow::Context;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

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

type Action = Box<dyn Fn(usize) + Send>;

/// What Ctrl-C does now; `None`: exit at once.
static ACTION: Mutex<Option<Action>> = Mutex::new(None);

/// Takes SIGINT for the process (once, at start): each Ctrl-C runs the current action with the
/// number of Ctrl-C so far (1 for the first), or exits with [`EXIT_CODE`] when there is none.
pub fn install() -> anyhow::Result<()> {
    let hits = AtomicUsize::new(0);
    ctrlc::set_handler(move || {
        let n = hits.fetch_add(1, Ordering::SeqCst) + 1;
        let action = ACTION.lock().unwrap_or_else(|e| e.into_inner());
        match action.as_ref() {
            Some(f) => f(n),
            None => std::process::exit(EXIT_CODE.into()),
        }
    })
    .context("cannot handle Ctrl-C")
}

/// Makes `on_interrupt` what Ctrl-C does from now on; it runs on a thread of its own.
pub fn on_ctrl_c(on_interrupt: impl Fn(usize) + Send + 'static) {
    *ACTION.lock().unwrap_or_else(|e| e.into_inner()) = Some(Box::new(on_interrupt));
}

/// How long after the first Ctrl-C a further one is taken as "quit now" rather than as the same
/// keypress repeated: stopping usually takes a step, and quitting would lose what was done.
const QUIT_AFTER: Duration = Duration::from_secs(1);

/// Ctrl-C for a command that waits on requests: the first cancels them through `cancel` (they
/// end as cancelled, with what they generated); another one, a second or more later, exits at
/// once.
pub fn cancel_on_ctrl_c(cancel: impl Fn() + Send + 'static) {
    let first = Mutex::new(None::<Instant>);
    on_ctrl_c(move |_| {
        let mut first = first.lock().unwrap_or_else(|e| e.into_inner());
        match *first {
            None => {
                *first = Some(Instant::now());
                eprintln!("\n[interrupted: stopping; Ctrl-C again to quit at once]");
                cancel();
            }
            Some(at) if at.elapsed() >= QUIT_AFTER => std::process::exit(EXIT_CODE.into()),
            Some(_) => {}
        }
    });
}
