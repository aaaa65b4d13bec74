//! An allocator that refuses absurd sizes: a case that asks for more than a limit in one
//! allocation, or holds more than a limit in all, stops the process with a message and a
//! backtrace instead of swapping the machine to death or being killed without a word. The code
//! under test must refuse absurd sizes itself (from counts it checked against the input); this
//! makes a failure to do so visible, and the same on every platform.
//!
//! Install it in a binary (`#[global_allocator] static A: Guard = Guard;`), then set limits.
//! It also tracks the peak of live bytes, so a runner can report the most one case grew memory.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static ONE_LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);
static LIVE_LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);

thread_local! {
    /// Set while a refusal is being reported: the report's own allocations pass unchecked.
    static REPORTING: Cell<bool> = const { Cell::new(false) };
}

/// The allocator: the system's, with limits.
pub struct Guard;

/// Sets the limits: the largest single allocation and the most bytes live at once.
pub fn set_limits(one: usize, live: usize) {
    ONE_LIMIT.store(one, Ordering::Relaxed);
    LIVE_LIMIT.store(live, Ordering::Relaxed);
}

/// Bytes live now.
pub fn live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// Starts a new peak from the bytes live now; returns it.
pub fn reset_peak() -> usize {
    let now = live();
    PEAK.store(now, Ordering::Relaxed);
    now
}

/// The most bytes live since [`reset_peak`].
pub fn peak() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Checks an allocation of `size` bytes that grows the live bytes by `growth`.
fn check(size: usize, growth: usize) {
    let live = LIVE.load(Ordering::Relaxed);
    let over_one = size > ONE_LIMIT.load(Ordering::Relaxed);
    let over_live = live.saturating_add(growth) > LIVE_LIMIT.load(Ordering::Relaxed);
    if !(over_one || over_live) {
        return;
    }
    // Not while reporting (nor on a thread being torn down).
    if REPORTING.try_with(|r| r.replace(true)).unwrap_or(true) {
        return;
    }
    eprintln!(
        "turbo-fuzz: refused an allocation of {size} bytes ({} live); limits: {} bytes in one \
         allocation, {} bytes live\n{}",
        live,
        ONE_LIMIT.load(Ordering::Relaxed),
        LIVE_LIMIT.load(Ordering::Relaxed),
        std::backtrace::Backtrace::force_capture()
    );
    std::process::abort();
}

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator with the caller's arguments; the
// bookkeeping around it touches only atomics and a const thread-local.
unsafe impl GlobalAlloc for Guard {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        check(layout.size(), layout.size());
        // SAFETY: forwarded as given.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check(layout.size(), layout.size());
        // SAFETY: forwarded as given.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as given.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            check(new_size, new_size - layout.size());
        }
        // SAFETY: forwarded as given.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                grew(new_size - layout.size());
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}
