//! Third-party parsers (the `tokenizers` crate, minijinja) can panic on hostile input: a
//! `tokenizer.json` or a chat template comes from a model file. Their calls run contained, so
//! that such a panic becomes an error of the file instead of ending the process, and prints
//! nothing.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Once;

thread_local! {
    /// Whether a panic on this thread happens inside [`contained`] (its message is not printed).
    static CONTAINED: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`; a panic inside it is returned as its message. The previous panic hook still runs
/// for every panic outside such calls.
pub(crate) fn contained<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !CONTAINED.with(Cell::get) {
                previous(info);
            }
        }));
    });
    let was = CONTAINED.with(|c| c.replace(true));
    let result = catch_unwind(AssertUnwindSafe(f));
    CONTAINED.with(|c| c.set(was));
    result.map_err(|payload| {
        payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "an internal error".to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_become_errors() {
        assert_eq!(contained(|| 3), Ok(3));
        let e = contained(|| -> u32 { panic!("bad {}", 1) }).unwrap_err();
        assert_eq!(e, "bad 1");
        let e = contained(|| -> u32 { panic!("static") }).unwrap_err();
        assert_eq!(e, "static");
    }
}
