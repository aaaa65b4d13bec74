//! `turbo-fuzz`: bounded fuzz runs on stable Rust, and their tools.
//!
//! ```text
//! turbo-fuzz run [TARGET...] [--cases N|xN] [--seed S] [--out DIR] [--max-deaths N]
//!                [--timeout SECS]
//! turbo-fuzz repro TARGET FILE...      run failing inputs again, in the foreground
//! turbo-fuzz dump TARGET SEED CASE FILE   write the input of one case
//! turbo-fuzz seeds DIR [--cases N]     write a corpus for cargo fuzz (DIR/TARGET/...)
//! turbo-fuzz unpack FILE DIR           an hf_model input as the directory it stands for
//! turbo-fuzz list
//! ```
//!
//! Every command runs under the limited allocator, so `repro` shows a refused allocation the way
//! the run saw it.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use turbo_fuzz::harness::{self, parse_u64, Plan};
use turbo_fuzz::{alloc, target, Target, TARGETS};

#[global_allocator]
static ALLOCATOR: alloc::Guard = alloc::Guard;

const USAGE: &str = "usage:
  turbo-fuzz run [TARGET...] [--cases N|xN] [--seed S] [--out DIR] [--max-deaths N] [--timeout SECS]
  turbo-fuzz repro TARGET FILE...
  turbo-fuzz dump TARGET SEED CASE FILE
  turbo-fuzz seeds DIR [--cases N]
  turbo-fuzz unpack FILE DIR
  turbo-fuzz list";

fn main() -> ExitCode {
    alloc::set_limits(harness::ONE_ALLOCATION_LIMIT, harness::LIVE_LIMIT);
    // Case files of `repro` and friends, removed on the way out (a worker's runner gives it a
    // directory of its own instead).
    let scratch = match std::env::var_os(turbo_fuzz::scratch::SCRATCH_ENV) {
        Some(_) => None,
        None => tempfile::Builder::new()
            .prefix("turbo-fuzz-")
            .tempdir()
            .ok(),
    };
    if let Some(dir) = &scratch {
        turbo_fuzz::scratch::set_root(dir.path());
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(code) => code,
        Err(message) => {
            eprintln!("turbo-fuzz: {message}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn find(name: &str) -> Result<&'static Target, String> {
    target(name).ok_or_else(|| {
        let names: Vec<&str> = TARGETS.iter().map(|t| t.name).collect();
        format!("no target '{name}' (targets: {})", names.join(", "))
    })
}

fn number(v: Option<&String>, what: &str) -> Result<u64, String> {
    v.and_then(|v| parse_u64(v))
        .ok_or_else(|| format!("{what}: expected a number"))
}

fn default_out() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir).join("turbo-fuzz"),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/turbo-fuzz"),
    }
}

fn run(args: &[String]) -> Result<ExitCode, String> {
    let Some((command, rest)) = args.split_first() else {
        return Err("no command".into());
    };
    match command.as_str() {
        "list" => {
            for t in TARGETS {
                println!("{} (CI: {} cases)", t.name, t.ci_cases);
            }
            Ok(ExitCode::SUCCESS)
        }
        "worker" => {
            let [name, seed, start, end, out] = rest else {
                return Err("worker TARGET SEED START END OUT".into());
            };
            harness::worker(
                find(name)?,
                number(Some(seed), "SEED")?,
                number(Some(start), "START")?,
                number(Some(end), "END")?,
                PathBuf::from(out),
            );
            Ok(ExitCode::SUCCESS)
        }
        "dump" => {
            let [name, seed, case, file] = rest else {
                return Err("dump TARGET SEED CASE FILE".into());
            };
            let input = harness::case_input(
                find(name)?,
                number(Some(seed), "SEED")?,
                number(Some(case), "CASE")?,
            );
            std::fs::write(file, input).map_err(|e| format!("{file}: {e}"))?;
            Ok(ExitCode::SUCCESS)
        }
        "repro" => {
            let Some((name, files)) = rest.split_first() else {
                return Err("repro TARGET FILE...".into());
            };
            let t = find(name)?;
            for file in files {
                let input = std::fs::read(file).map_err(|e| format!("{file}: {e}"))?;
                eprintln!("running {file} ({} bytes)", input.len());
                // Caught (after the hook has printed it) so that the scratch directory goes.
                let run = std::panic::AssertUnwindSafe(|| harness::repro(t, &input));
                if std::panic::catch_unwind(run).is_err() {
                    eprintln!("{file}: FAILED");
                    return Ok(ExitCode::from(101));
                }
                eprintln!("{file}: no failure");
            }
            Ok(ExitCode::SUCCESS)
        }
        "unpack" => {
            let [file, dir] = rest else {
                return Err("unpack FILE DIR".into());
            };
            let input = std::fs::read(file).map_err(|e| format!("{file}: {e}"))?;
            std::fs::create_dir_all(dir).map_err(|e| format!("{dir}: {e}"))?;
            for (name, bytes) in turbo_fuzz::hf_model::FileSet::decode(&input).files() {
                let path = Path::new(dir).join(name);
                std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
                println!("{} ({} bytes)", path.display(), bytes.len());
            }
            Ok(ExitCode::SUCCESS)
        }
        "seeds" => {
            let Some((dir, opts)) = rest.split_first() else {
                return Err("seeds DIR [--cases N]".into());
            };
            let cases = match opts {
                [] => 16,
                [flag, n] if flag == "--cases" => number(Some(n), "--cases")?,
                _ => return Err("seeds DIR [--cases N]".into()),
            };
            for t in TARGETS {
                let out = Path::new(dir).join(t.name);
                std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
                let seeds = (t.seeds)();
                for (i, s) in seeds.iter().enumerate() {
                    std::fs::write(out.join(format!("seed-{i}")), s).map_err(|e| e.to_string())?;
                }
                for i in 0..cases {
                    let input = harness::case_input(t, harness::DEFAULT_SEED, i);
                    std::fs::write(out.join(format!("case-{i}")), input)
                        .map_err(|e| e.to_string())?;
                }
                println!(
                    "{}: {} seeds and {cases} cases in {}",
                    t.name,
                    seeds.len(),
                    out.display()
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        "run" => {
            let mut names = Vec::new();
            let (mut cases, mut seed, mut out) = (None, None, default_out());
            let (mut max_deaths, mut timeout) = (None, None);
            let mut it = rest.iter();
            while let Some(a) = it.next() {
                match a.as_str() {
                    "--cases" => cases = Some(it.next().ok_or("--cases N")?.clone()),
                    "--seed" => seed = Some(number(it.next(), "--seed")?),
                    "--out" => out = PathBuf::from(it.next().ok_or("--out DIR")?),
                    "--max-deaths" => max_deaths = Some(number(it.next(), "--max-deaths")?),
                    "--timeout" => timeout = Some(number(it.next(), "--timeout")?),
                    name => names.push(find(name)?),
                }
            }
            if names.is_empty() {
                names = TARGETS.to_vec();
            }
            let bin = std::env::current_exe().map_err(|e| e.to_string())?;
            let mut failed = false;
            for t in names {
                let mut plan = Plan::from_env(t, out.clone());
                if let Some(c) = &cases {
                    plan.cases = harness::parse_cases(c, harness::ci_cases(t))
                        .ok_or("--cases: expected a count (20000) or a multiple (x10)")?;
                }
                if let Some(s) = seed {
                    plan.seed = s;
                }
                if let Some(n) = max_deaths {
                    plan.max_deaths = n as usize;
                }
                if let Some(t) = timeout {
                    plan.case_timeout = std::time::Duration::from_secs(t);
                }
                let report = harness::supervise(&bin, &plan);
                println!("{report}");
                failed |= !report.findings.is_empty();
            }
            Ok(if failed {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            })
        }
        other => Err(format!("unknown command '{other}'")),
    }
}
