//! A bounded fuzz run on stable Rust.
//!
//! The runner ([`supervise`]) starts the `turbo-fuzz` binary as a worker ([`worker`]) that makes
//! cases `start..end` of a seed, one after the other, and runs each under `catch_unwind`, on a
//! thread with Rust's default 2 MiB stack, with the limited allocator ([`crate::alloc`]). The
//! worker names each case on stdout before running it; a panic is reported by the worker and the
//! run goes on. An abort, a stack overflow or a refused allocation ends the worker: the runner
//! names the case it was running, has the input written again (cases are a function of seed and
//! index), and starts a new worker after it. So does a case that makes no progress within the
//! time limit, which the runner kills.
//!
//! Every failing input is written to the output directory with what was seen (message,
//! backtrace); `turbo-fuzz repro TARGET FILE` runs it again in the foreground.

use crate::rng::Rng;
use crate::scratch::SCRATCH_ENV;
use crate::Target;
use std::collections::BTreeMap;
use std::fmt;
use std::io::{BufRead, BufReader, Read, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Environment variable: cases per target, as a count (`20000`) or a multiple of the CI count
/// (`x10`).
pub const CASES_ENV: &str = "TURBO_FUZZ_CASES";
/// Environment variable: the run's seed (default [`DEFAULT_SEED`]).
pub const SEED_ENV: &str = "TURBO_FUZZ_SEED";
pub const DEFAULT_SEED: u64 = 0x7572_626f_2d66_757a;

/// Lines of the worker's protocol on stdout start with this.
const TAG: &str = "@@turbo-fuzz";
/// Cases between the worker's reports of its statistics.
const STATS_EVERY: u64 = 100;
/// Failing inputs kept per kind of failure (the rest are counted).
const KEEP_PER_SIGNATURE: u64 = 3;
/// Time the worker may take to make its seeds (SmolLM2's tokenizer, tiny models) before case 0.
const READY_TIMEOUT: Duration = Duration::from_secs(600);
/// Stack of the thread cases run on: what `std::thread::spawn` gives (tokio's workers too).
pub const CASE_STACK: usize = 2 << 20;
/// Allocation limits of a worker: one allocation, and all live bytes.
pub const ONE_ALLOCATION_LIMIT: usize = 256 << 20;
pub const LIVE_LIMIT: usize = 2 << 30;

/// What to run.
#[derive(Clone, Debug)]
pub struct Plan {
    pub target: &'static Target,
    pub seed: u64,
    pub cases: u64,
    /// Where failing inputs go.
    pub out: PathBuf,
    /// Longest a case may run.
    pub case_timeout: Duration,
    /// Workers that may die (abort, hang) before the run stops early.
    pub max_deaths: usize,
}

impl Plan {
    /// The target's CI plan: its CI count of cases (a twentieth in debug builds, which are 20 to
    /// 50 times slower), scaled by `TURBO_FUZZ_CASES`, seeded by `TURBO_FUZZ_SEED` or the fixed
    /// default.
    pub fn from_env(target: &'static Target, out: PathBuf) -> Plan {
        let ci = ci_cases(target);
        let cases = match std::env::var(CASES_ENV) {
            Ok(v) => parse_cases(&v, ci).unwrap_or_else(|| {
                panic!("{CASES_ENV}={v:?}: expected a count (20000) or a multiple (x10)")
            }),
            Err(_) => ci,
        };
        let seed = match std::env::var(SEED_ENV) {
            Ok(v) => parse_u64(&v).unwrap_or_else(|| panic!("{SEED_ENV}={v:?}: not a number")),
            Err(_) => DEFAULT_SEED,
        };
        Plan {
            target,
            seed,
            cases,
            out,
            case_timeout: Duration::from_secs(if cfg!(debug_assertions) { 120 } else { 20 }),
            max_deaths: 10,
        }
    }
}

/// The target's CI count of cases for this build (a twentieth in debug builds).
pub fn ci_cases(target: &Target) -> u64 {
    if cfg!(debug_assertions) {
        (target.ci_cases / 20).max(50)
    } else {
        target.ci_cases
    }
}

/// A count of cases: `20000`, or `x10` for ten times `ci`.
pub fn parse_cases(v: &str, ci: u64) -> Option<u64> {
    match v.strip_prefix('x') {
        Some(m) => Some((ci as f64 * m.parse::<f64>().ok()?).round() as u64),
        None => v.parse().ok(),
    }
}

/// A number in decimal or `0x` hexadecimal.
pub fn parse_u64(v: &str) -> Option<u64> {
    match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    }
}

/// How a case failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// A panic, caught: an invariant failed or the code under test panicked.
    Panic,
    /// The worker died: an abort (a refused allocation among them), a stack overflow, a signal.
    Crash,
    /// No progress within the time limit.
    Timeout,
}

/// One kind of failure: the first case that showed it, and how many did.
#[derive(Clone, Debug)]
pub struct Finding {
    pub kind: Kind,
    /// What tells failures apart: the panic's location, or the first telling line of a crash.
    pub signature: String,
    pub first_case: u64,
    pub count: u64,
    /// The first failing input.
    pub input: PathBuf,
    /// Message, backtrace, or the end of the worker's stderr.
    pub details: String,
}

/// The result of a run.
#[derive(Clone, Debug)]
pub struct Report {
    pub target: &'static str,
    pub seed: u64,
    pub planned: u64,
    /// Cases started.
    pub cases: u64,
    /// Cases whose input went all the way through (see [`crate::accept`]), as last reported.
    pub accepted: u64,
    pub elapsed: Duration,
    /// The slowest case that finished, and its index.
    pub slowest: (Duration, u64),
    /// The most one case grew live memory, in bytes, and its index.
    pub max_growth: (u64, u64),
    pub findings: Vec<Finding>,
    /// Whether the run stopped before its last case (too many workers died).
    pub stopped_early: bool,
    /// Which optional seeds the workers had (see [`crate::seeds::describe`]).
    pub seeds: String,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}: {} of {} cases (seed {:#x}, {} accepted all the way) in {:.1} s; slowest case \
             #{} took {} ms; most memory one case grew: {:.1} MiB (#{}); {} kind(s) of failure{}",
            self.target,
            self.cases,
            self.planned,
            self.seed,
            self.accepted,
            self.elapsed.as_secs_f64(),
            self.slowest.1,
            self.slowest.0.as_millis(),
            self.max_growth.0 as f64 / (1 << 20) as f64,
            self.max_growth.1,
            self.findings.len(),
            if self.stopped_early {
                " (stopped early: too many workers died)"
            } else {
                ""
            }
        )?;
        writeln!(f, "  seeds: {}", self.seeds)?;
        for x in &self.findings {
            writeln!(
                f,
                "\n  {:?} x{} (first: case {}): {}\n  input: {}\n  reproduce: cargo run --release -p turbo-fuzz -- repro {} {}\n{}",
                x.kind,
                x.count,
                x.first_case,
                x.signature,
                x.input.display(),
                self.target,
                x.input.display(),
                indent(&x.details)
            )?;
        }
        Ok(())
    }
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("    {l}\n")).collect()
}

/// The input file of case `index`.
pub fn input_path(out: &Path, target: &str, seed: u64, index: u64) -> PathBuf {
    out.join(format!("{target}-seed{seed:x}-case{index}.bin"))
}

/// Makes the input of case `index`.
pub fn case_input(target: &Target, seed: u64, index: u64) -> Vec<u8> {
    (target.generate)(&mut Rng::for_case(seed, index))
}

// ---------------------------------------------------------------------------------------------
// The worker.

/// The first panic since the last case started: message, location, backtrace.
static PANIC: Mutex<Option<(String, String, String)>> = Mutex::new(None);

fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let message = match info.payload().downcast_ref::<&str>() {
            Some(s) => s.to_string(),
            None => match info.payload().downcast_ref::<String>() {
                Some(s) => s.clone(),
                None => "(a panic without a message)".into(),
            },
        };
        let location = info
            .location()
            .map_or("?".into(), |l| format!("{}:{}", l.file(), l.line()));
        let backtrace = std::backtrace::Backtrace::force_capture().to_string();
        let mut slot = PANIC.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some((message, location, backtrace));
        }
    }));
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{TAG} {line}");
    let _ = out.flush();
}

/// Runs cases `start..end`, reporting on stdout; returns when all ran. Panics are caught and
/// reported; anything worse ends the process, which the runner sees.
pub fn worker(target: &'static Target, seed: u64, start: u64, end: u64, out: PathBuf) {
    install_panic_hook();
    let thread = std::thread::Builder::new()
        .name("case".into())
        .stack_size(CASE_STACK)
        .spawn(move || run_cases(target, seed, start, end, &out))
        .expect("a thread for the cases");
    if thread.join().is_err() {
        std::process::exit(3);
    }
}

fn run_cases(target: &'static Target, seed: u64, start: u64, end: u64, out: &Path) {
    // The seeds are made before the first case (they are shared and may take a while).
    let _ = case_input(target, seed, start);
    say(&format!("ready {}", crate::seeds::describe()));
    let mut seen: BTreeMap<String, u64> = BTreeMap::new();
    let (mut slowest, mut slowest_case) = (Duration::ZERO, start);
    let (mut growth, mut growth_case) = (0usize, start);
    for i in start..end {
        say(&format!("case {i}"));
        let input = case_input(target, seed, i);
        *PANIC.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let base = crate::alloc::reset_peak();
        let t0 = Instant::now();
        let result = catch_unwind(AssertUnwindSafe(|| (target.run)(&input)));
        let took = t0.elapsed();
        let grew = crate::alloc::peak().saturating_sub(base);
        if took > slowest {
            (slowest, slowest_case) = (took, i);
        }
        if grew > growth {
            (growth, growth_case) = (grew, i);
        }
        if i % STATS_EVERY == 0 || i + 1 == end {
            // Cumulative, so that a worker that dies later has reported what it saw.
            say(&format!(
                "stats {} {slowest_case} {growth} {growth_case} {}",
                slowest.as_micros(),
                crate::accepted()
            ));
        }
        if result.is_err() {
            let (message, location, backtrace) = PANIC
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .unwrap_or_else(|| ("(no message)".into(), "?".into(), String::new()));
            let n = seen.entry(location.clone()).or_insert(0);
            *n += 1;
            if *n <= KEEP_PER_SIGNATURE {
                let path = input_path(out, target.name, seed, i);
                let _ = std::fs::write(&path, &input);
                let _ = std::fs::write(
                    path.with_extension("txt"),
                    format!("panicked at {location}:\n{message}\n\n{backtrace}"),
                );
            }
            let first_line = message.lines().next().unwrap_or("");
            let short: String = first_line.chars().take(160).collect();
            say(&format!(
                "fail {i} panic at {location}: {}",
                short.escape_debug()
            ));
        }
    }
    say("done");
}

// ---------------------------------------------------------------------------------------------
// The runner.

/// Events of one worker.
enum Event {
    Line(String),
    Closed,
}

/// Runs `plan` with `bin` (the `turbo-fuzz` binary) as its workers.
pub fn supervise(bin: &Path, plan: &Plan) -> Report {
    let t0 = Instant::now();
    let name = plan.target.name;
    std::fs::create_dir_all(&plan.out)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", plan.out.display()));
    let scratch = tempfile::Builder::new()
        .prefix("turbo-fuzz-scratch-")
        .tempdir()
        .expect("a scratch directory");
    let mut report = Report {
        target: name,
        seed: plan.seed,
        planned: plan.cases,
        cases: 0,
        accepted: 0,
        elapsed: Duration::ZERO,
        slowest: (Duration::ZERO, 0),
        max_growth: (0, 0),
        findings: Vec::new(),
        stopped_early: false,
        seeds: String::new(),
    };
    let mut findings: BTreeMap<(Kind, String), Finding> = BTreeMap::new();
    let mut next = 0;
    let mut deaths = 0;
    while next < plan.cases {
        let mut child = Command::new(bin)
            .args(["worker", name])
            .arg(plan.seed.to_string())
            .arg(next.to_string())
            .arg(plan.cases.to_string())
            .arg(&plan.out)
            .env(SCRATCH_ENV, scratch.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let (tx, rx) = mpsc::channel();
        let stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                match line {
                    Ok(l) => {
                        if tx.send(Event::Line(l)).is_err() {
                            return;
                        }
                    }
                    Err(_) => break,
                }
            }
            let _ = tx.send(Event::Closed);
        });
        let mut stderr = child.stderr.take().expect("piped stderr");
        let stderr_tail = std::thread::spawn(move || {
            let mut all = Vec::new();
            let mut buf = [0u8; 8192];
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                all.extend_from_slice(&buf[..n]);
                if all.len() > 1 << 20 {
                    all.drain(..all.len() - (64 << 10));
                }
            }
            let start = all.len().saturating_sub(64 << 10);
            String::from_utf8_lossy(&all[start..]).into_owned()
        });

        let mut ready = false;
        let mut worker_accepted = 0;
        let mut current: Option<u64> = None;
        let mut done = false;
        let died: Option<(Kind, String)> = loop {
            let limit = if ready {
                plan.case_timeout
            } else {
                READY_TIMEOUT
            };
            match rx.recv_timeout(limit) {
                Ok(Event::Line(line)) => {
                    let Some(rest) = line.strip_prefix(TAG).map(str::trim_start) else {
                        continue;
                    };
                    if let Some(seeds) = rest.strip_prefix("ready") {
                        ready = true;
                        report.seeds = seeds.trim().to_string();
                    } else if let Some(i) = rest.strip_prefix("case ") {
                        current = i.parse().ok();
                        report.cases += 1;
                    } else if let Some(fail) = rest.strip_prefix("fail ") {
                        let (i, signature) = fail.split_once(' ').unwrap_or((fail, ""));
                        let i: u64 = i.parse().unwrap_or(0);
                        let input = input_path(&plan.out, name, plan.seed, i);
                        let details = std::fs::read_to_string(input.with_extension("txt"))
                            .unwrap_or_default();
                        let location = signature.split(": ").next().unwrap_or(signature);
                        add(
                            &mut findings,
                            Kind::Panic,
                            location,
                            signature,
                            i,
                            input,
                            details,
                        );
                    } else if let Some(stats) = rest.strip_prefix("stats ") {
                        let v: Vec<u64> = stats.split(' ').filter_map(|s| s.parse().ok()).collect();
                        if let [slow_us, slow_case, grew, grew_case, accepted] = v[..] {
                            let slow = Duration::from_micros(slow_us);
                            if slow > report.slowest.0 {
                                report.slowest = (slow, slow_case);
                            }
                            if grew > report.max_growth.0 {
                                report.max_growth = (grew, grew_case);
                            }
                            worker_accepted = accepted;
                        }
                    } else if rest == "done" {
                        done = true;
                    }
                }
                Ok(Event::Closed) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = child.wait().expect("waiting for the worker");
                    if done && status.success() {
                        break None;
                    }
                    break Some((Kind::Crash, format!("worker exited: {}", describe(status))));
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break Some((
                        Kind::Timeout,
                        format!(
                            "no progress for {} s{}",
                            limit.as_secs(),
                            if ready { "" } else { " while making the seeds" }
                        ),
                    ));
                }
            }
        };
        let tail = stderr_tail.join().unwrap_or_default();
        report.accepted += worker_accepted;
        let Some((kind, what)) = died else {
            next = plan.cases;
            continue;
        };
        deaths += 1;
        let Some(i) = current else {
            // Died before its first case: nothing to blame on an input.
            add(
                &mut findings,
                kind,
                &what,
                &what,
                next,
                PathBuf::new(),
                tail,
            );
            report.stopped_early = true;
            break;
        };
        let input = input_path(&plan.out, name, plan.seed, i);
        let _ = Command::new(bin)
            .args(["dump", name])
            .arg(plan.seed.to_string())
            .arg(i.to_string())
            .arg(&input)
            .env(SCRATCH_ENV, scratch.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let signature = crash_signature(&tail).unwrap_or(what.clone());
        // A worker that refused an allocation may take longer than the time limit to print
        // the backtrace: it died of the allocation.
        let kind = match tail.contains("turbo-fuzz: refused an allocation") {
            true => Kind::Crash,
            false => kind,
        };
        let details = format!("{what}\n--- end of the worker's stderr ---\n{tail}");
        let _ = std::fs::write(input.with_extension("txt"), &details);
        add(
            &mut findings,
            kind,
            &signature,
            &signature,
            i,
            input,
            details,
        );
        next = i + 1;
        if deaths >= plan.max_deaths && next < plan.cases {
            report.stopped_early = true;
            break;
        }
    }
    report.findings = findings.into_values().collect();
    report.elapsed = t0.elapsed();
    report
}

fn add(
    findings: &mut BTreeMap<(Kind, String), Finding>,
    kind: Kind,
    key: &str,
    signature: &str,
    case: u64,
    input: PathBuf,
    details: String,
) {
    findings
        .entry((kind, key.to_string()))
        .and_modify(|f| f.count += 1)
        .or_insert(Finding {
            kind,
            signature: signature.to_string(),
            first_case: case,
            count: 1,
            input,
            details,
        });
}

fn describe(status: std::process::ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            let name = match sig {
                6 => " (SIGABRT)",
                9 => " (SIGKILL: out of memory?)",
                11 => " (SIGSEGV)",
                7 => " (SIGBUS)",
                _ => "",
            };
            return format!("signal {sig}{name}");
        }
    }
    status.to_string()
}

/// The line of a dead worker's stderr that says what killed it.
fn crash_signature(stderr: &str) -> Option<String> {
    const TELLING: &[&str] = &[
        "turbo-fuzz: refused an allocation",
        "memory allocation of",
        "has overflowed its stack",
        "panicked at",
        "fatal runtime error",
    ];
    for needle in TELLING {
        if let Some(line) = stderr.lines().find(|l| l.contains(needle)) {
            // Sizes differ from case to case; the kind of failure does not.
            let general: String = line
                .split(' ')
                .map(|w| {
                    if w.chars().all(|c| c.is_ascii_digit() || c == '(') && !w.is_empty() {
                        "N"
                    } else {
                        w
                    }
                })
                .collect::<Vec<_>>()
                .join(" ");
            // A refused allocation is told apart by where it came from.
            if *needle == "turbo-fuzz: refused an allocation" {
                return Some(format!(
                    "allocation refused (over the limits) at {}",
                    allocation_site(stderr)
                ));
            }
            return Some(general);
        }
    }
    None
}

/// Where a refused allocation came from: the first frame of its backtrace in code outside the
/// allocator and the standard library (frames are a name, then `at path:line:column`).
fn allocation_site(stderr: &str) -> String {
    let lines: Vec<&str> = stderr.lines().map(str::trim).collect();
    for (i, line) in lines.iter().enumerate() {
        let Some(path) = line.strip_prefix("at ") else {
            continue;
        };
        // The allocator, its shim (the `#[global_allocator]` line), the standard library.
        let plumbing = ["turbo-fuzz/src/alloc.rs", "turbo-fuzz/src/bin/", "./src/"];
        if path.starts_with("/rustc/") || plumbing.iter().any(|p| path.contains(p)) {
            continue;
        }
        let name = lines[..i]
            .iter()
            .rev()
            .find_map(|l| l.split_once(": ").filter(|(n, _)| n.parse::<u32>().is_ok()))
            .map_or("?", |(_, name)| name);
        return format!("{name} at {path}");
    }
    "an unknown site".into()
}

/// Runs one input in this process (for reproducing): panics come out as panics.
pub fn repro(target: &Target, input: &[u8]) {
    (target.run)(input);
}
