//! `turbo eval-kv`: what KV eviction costs in quality, measured through the serving path.
//!
//! For each text, the first `--prompt-tokens` tokens are the prompt; the next `--eval-tokens`
//! are fed one at a time as decode steps of the engine (teacher forcing) with each policy and
//! budget on, all as requests of one persistent batch. `nll` is the mean negative
//! log-likelihood of those tokens, `greedy_agree` the share of steps whose most likely token is
//! full attention's. With `--task summarize`, the prompt is wrapped in the chat template with a
//! summary instruction, the model writes a greedy summary, and `rouge_l` compares it with full
//! attention's (ROUGE-L F1 over lowercase words).
//!
//! `--plot` draws the means over the texts against budget (see `plot`); `--from-json` reads the
//! rows of an earlier `--json` run instead of running the model, to print or plot them again.

use crate::eviction::{budget_size, KvPolicyArgs};
use crate::plot;
use crate::runtime::ModelArgs;
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use turbo_engine::{ChatMessage, Engine, EngineConfig, KvSize, RequestStream};
use turbo_keyformer::PolicyKind;
use turbo_scheduler::{Event, Request};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Task {
    /// Perplexity and greedy agreement on the text's continuation.
    Continue,
    /// ROUGE-L of a greedy summary against full attention's.
    Summarize,
}

#[derive(Args)]
pub struct EvalKvArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Texts to evaluate on (e.g. from `scripts/fetch_eval_texts.py`).
    #[arg(
        long,
        required_unless_present = "from_json",
        conflicts_with = "from_json",
        num_args = 1..
    )]
    text: Vec<PathBuf>,
    /// Prompt tokens taken from the start of each text.
    #[arg(long, default_value_t = 4096)]
    prompt_tokens: usize,
    /// Tokens evaluated after the prompt (or the summary's length).
    #[arg(long, default_value_t = 512)]
    eval_tokens: usize,
    /// Policies, comma-separated; full attention always runs as the reference.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "keyformer,h2o,window,sink"
    )]
    policies: Vec<PolicyKind>,
    /// Budgets as fractions of the prompt, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0.2,0.3,0.5,0.7,0.9")]
    budgets: Vec<f64>,
    #[arg(long, value_enum, default_value = "continue")]
    task: Task,
    /// Requests running at once.
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Keyformer's noise seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    eviction: KvPolicyArgs,
    /// One JSON object per (text, policy, budget) instead of a table.
    #[arg(long)]
    json: bool,
    /// Also draw quality against budget into this PNG, one line per policy (means over the
    /// texts, full attention the reference): the rows are hard to read at a glance. Checked
    /// before the run starts, so that a bad path does not waste one.
    #[arg(long, value_name = "FILE.png")]
    plot: Option<PathBuf>,
    /// Read the rows of an earlier `--json` run from this file instead of running the model,
    /// to print or plot them again (the model, text and run options are not used).
    #[arg(long, value_name = "FILE.jsonl")]
    from_json: Option<PathBuf>,
    /// Write full attention's greedy tokens of each text to this JSON file (text name -> token
    /// ids), for `--greedy-ref` on another device, dtype or build.
    #[arg(long, value_name = "FILE.json", conflicts_with = "from_json")]
    greedy_out: Option<PathBuf>,
    /// Measure `agree` against the greedy tokens of an earlier `--greedy-out` (e.g. the CPU's
    /// exact f32 run) instead of this run's full attention: teacher-forced top-1 agreement
    /// between two runs of the same model and texts.
    #[arg(long, value_name = "FILE.json", conflicts_with = "from_json")]
    greedy_ref: Option<PathBuf>,
}

/// One (text, policy, budget) result: a line of `--json`'s output, read back by
/// `--from-json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Row {
    pub text: String,
    pub task: String,
    pub policy: String,
    pub budget: f64,
    pub kv_tokens: usize,
    pub nll: f64,
    /// `exp(nll)`; JSON has no infinity, so one past f64's range is written as null and read
    /// back as infinity.
    #[serde(deserialize_with = "null_as_infinity")]
    pub ppl: f64,
    pub greedy_agree: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rouge_l: Option<f64>,
}

fn null_as_infinity<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    use serde::Deserialize;
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::INFINITY))
}

/// What one request produced.
#[derive(Clone)]
struct Outcome {
    nll: f64,
    greedy: Vec<u32>,
    text: String,
    kv_tokens: usize,
}

pub fn run(args: EvalKvArgs) -> Result<()> {
    if let Some(path) = &args.plot {
        plot::check_writable(path)?;
    }
    if let Some(path) = &args.greedy_out {
        crate::output::check_writable("--greedy-out", path)?;
    }
    // The policies and budgets come from --policies and --budgets; the per-run flags would be
    // ignored silently.
    let e = &args.eviction;
    if e.kv_policy != turbo_keyformer::PolicyKind::Full
        || e.kv_budget.is_some()
        || e.kv_budget_tokens.is_some()
    {
        bail!("eval-kv takes its policies and budgets from --policies and --budgets, not --kv-policy, --kv-budget or --kv-budget-tokens");
    }
    let (rows, source) = match &args.from_json {
        Some(path) => {
            let rows = read_rows(path)?;
            // Rows that cannot be plotted fail before anything is printed.
            if args.plot.is_some() {
                plot::means(&rows)?;
            }
            print_header(args.json)?;
            for row in &rows {
                print_row(row, args.json)?;
            }
            let name = path.file_name().unwrap_or(path.as_os_str());
            (rows, name.to_string_lossy().into_owned())
        }
        None => {
            let model = args.model.model.as_deref().map_or_else(
                || "the default model".to_string(),
                |m| {
                    m.file_name()
                        .unwrap_or(m.as_os_str())
                        .to_string_lossy()
                        .into_owned()
                },
            );
            let source = format!(
                "{model}, N = {}, K = {}",
                args.prompt_tokens, args.eval_tokens
            );
            (evaluate(&args)?, source)
        }
    };
    if let Some(path) = &args.plot {
        let means = plot::means(&rows)?;
        plot::render(&means, &plot::caption(&means, &source), path)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// Reads `--json` rows, one a line (blank lines skipped).
fn read_rows(path: &Path) -> Result<Vec<Row>> {
    // Saved rows are a few hundred bytes each: a million of them is far more than any run makes.
    let limit = 256 << 20;
    let content = turbo_engine::limits::read_file_bounded(path, limit)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let mut rows = Vec::new();
    for (i, line) in content.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let row = serde_json::from_str(line).with_context(|| {
            format!(
                "{} line {}: not a row of `eval-kv --json`",
                path.display(),
                i + 1
            )
        })?;
        rows.push(row);
    }
    anyhow::ensure!(!rows.is_empty(), "{} has no rows", path.display());
    Ok(rows)
}

fn print_header(json: bool) -> Result<()> {
    if !json {
        outln!(
            "{:<28} {:<10} {:>6} {:>9} {:>9} {:>9} {:>8}",
            "text",
            "policy",
            "budget",
            "kv_tokens",
            "nll",
            "ppl",
            "agree"
        )?;
    }
    Ok(())
}

fn print_row(row: &Row, json: bool) -> Result<()> {
    if json {
        outln!("{}", serde_json::to_string(row)?)?;
    } else {
        outln!(
            "{:<28} {:<10} {:>6.2} {:>9} {:>9.4} {:>9.3} {:>8.3}{}",
            row.text.chars().take(28).collect::<String>(),
            row.policy,
            row.budget,
            row.kv_tokens,
            row.nll,
            row.ppl,
            row.greedy_agree,
            row.rouge_l
                .map(|r| format!(" rouge_l {r:.3}"))
                .unwrap_or_default()
        )?;
    }
    Ok(())
}

/// Runs the model on every text with every policy and budget, printing each row as it comes
/// (a run takes minutes) and returning them all.
fn evaluate(args: &EvalKvArgs) -> Result<Vec<Row>> {
    anyhow::ensure!(
        args.prompt_tokens > 0 && args.eval_tokens > 0,
        "--prompt-tokens and --eval-tokens must be positive"
    );
    anyhow::ensure!(args.max_batch > 0, "--max-batch must be positive");
    for &b in &args.budgets {
        anyhow::ensure!(
            b > 0.0 && b <= 1.0,
            "budgets are fractions in (0, 1], not {b}"
        );
    }
    // A reference read (and its bound checked) before the model loads.
    let greedy_ref: Option<std::collections::HashMap<String, Vec<u32>>> = match &args.greedy_ref {
        Some(path) => {
            let text = turbo_engine::limits::read_file_bounded(path, 64 << 20)
                .with_context(|| format!("cannot read {}", path.display()))?;
            Some(serde_json::from_str(&text).with_context(|| {
                format!("{}: not a file of `eval-kv --greedy-out`", path.display())
            })?)
        }
        None => None,
    };
    let mut greedy_out = std::collections::BTreeMap::new();
    let configs: Vec<(PolicyKind, f64)> = args
        .policies
        .iter()
        .filter(|&&p| p != PolicyKind::Full)
        .flat_map(|&p| args.budgets.iter().map(move |&b| (p, b)))
        .collect();
    // Every request of a text is queued at once; nothing is shared between them, so that a
    // resident prefix never stands in for a policy's choice.
    let engine = Engine::start(EngineConfig {
        kv: KvSize::Default {
            cpu_slots: args.max_batch,
            cpu_tokens_per_slot: args.prompt_tokens.saturating_add(args.eval_tokens) + 256,
        },
        max_batch: args.max_batch,
        max_batched_tokens: 2048.max(args.max_batch),
        prefill_chunk: 512,
        prefix_caching: false,
        max_pending: configs.len() + 1,
        ..args.model.engine_config()?
    })?;
    let context = engine.info().context_length;
    anyhow::ensure!(
        args.prompt_tokens.saturating_add(args.eval_tokens) <= context,
        "--prompt-tokens + --eval-tokens = {} is more than the model's context of {context}",
        args.prompt_tokens.saturating_add(args.eval_tokens)
    );
    // Every text is read and tokenized before any is evaluated: a missing, short or unreadable
    // one fails the command before the others' time is spent.
    let (n, k) = (args.prompt_tokens, args.eval_tokens);
    let mut texts = Vec::with_capacity(args.text.len());
    for path in &args.text {
        // Only the text's first prompt + eval tokens are used: its head is read, never more
        // (as many bytes as that many tokens can stand for).
        let info = engine.info();
        let limit = info.max_bytes_per_token.saturating_mul((n + k) as u64);
        let content = read_head(path, limit.min(info.max_prompt_bytes))?;
        // The head may hold more tokens than the context (only the first n + k are kept), so
        // it is tokenized directly rather than as a prompt, which would be refused.
        let ids = engine.tokenizer().encode_with_bos(&content)?;
        if ids.len() < n + k {
            bail!(
                "{} has {} tokens, fewer than --prompt-tokens + --eval-tokens = {}",
                path.display(),
                ids.len(),
                n + k
            );
        }
        texts.push((path, ids));
    }
    print_header(args.json)?;
    let mut rows = Vec::new();
    for (path, ids) in texts {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let (prompt, forced) = match args.task {
            Task::Continue => (ids[..n].to_vec(), ids[n..n + k].to_vec()),
            Task::Summarize => {
                let text = engine.tokenizer().decode(&ids[..n])?;
                let message = format!("{text}\n\nSummarize the text above in a few sentences.");
                (
                    engine.chat_prompt(&[ChatMessage::new("user", message)])?,
                    Vec::new(),
                )
            }
        };
        let request = |policy: PolicyKind, budget: Option<f64>| -> Result<Request> {
            let size = budget_size(budget, None);
            Ok(Request {
                max_tokens: k,
                ignore_eos: args.task == Task::Continue,
                logprobs: Some(1),
                forced_tokens: forced.clone(),
                kv_eviction: args.eviction.eviction_with(policy, size, args.seed)?,
                ..Request::new(prompt.clone())
            })
        };
        let full = engine.submit(request(PolicyKind::Full, None)?)?;
        let streams = configs
            .iter()
            .map(|&(p, b)| Ok(engine.submit(request(p, Some(b))?)?))
            .collect::<Result<Vec<_>>>()?;
        let full = collect(full)?;
        greedy_out.insert(name.clone(), full.greedy.clone());
        let reference = match &greedy_ref {
            Some(r) => r
                .get(&name)
                .cloned()
                .with_context(|| format!("the --greedy-ref file has no tokens for {name}"))?,
            None => full.greedy.clone(),
        };
        anyhow::ensure!(
            reference.len() == full.greedy.len(),
            "the --greedy-ref tokens of {name} are {} steps, this run's {}",
            reference.len(),
            full.greedy.len()
        );
        let mut results = vec![(PolicyKind::Full, 1.0, full.clone())];
        for (&(p, b), s) in configs.iter().zip(streams) {
            results.push((p, b, collect(s)?));
        }
        for (policy, budget, o) in results {
            let agree = o
                .greedy
                .iter()
                .zip(&reference)
                .filter(|(a, b)| a == b)
                .count() as f64
                / reference.len().max(1) as f64;
            let row = Row {
                text: name.clone(),
                task: match args.task {
                    Task::Continue => "continue",
                    Task::Summarize => "summarize",
                }
                .to_string(),
                policy: policy.to_string(),
                budget,
                kv_tokens: o.kv_tokens,
                nll: o.nll,
                ppl: o.nll.exp(),
                greedy_agree: agree,
                rouge_l: (args.task == Task::Summarize).then(|| rouge_l(&o.text, &full.text)),
            };
            print_row(&row, args.json)?;
            rows.push(row);
        }
    }
    engine.shutdown(std::time::Duration::ZERO);
    if let Some(path) = &args.greedy_out {
        std::fs::write(path, serde_json::to_string(&greedy_out)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(rows)
}

/// Reads a request's events to its end.
fn collect(mut stream: RequestStream) -> Result<Outcome> {
    let (mut sum, mut count, mut greedy) = (0.0f64, 0usize, Vec::new());
    loop {
        match stream.blocking_next() {
            Some(Event::Logprobs(lp)) => {
                sum -= f64::from(lp.logprob);
                count += 1;
                greedy.push(lp.top.first().map_or(lp.token, |t| t.0));
            }
            Some(Event::Finished(c)) => {
                return Ok(Outcome {
                    nll: sum / count.max(1) as f64,
                    greedy,
                    text: c.text,
                    kv_tokens: c.kv_tokens,
                })
            }
            Some(Event::Failed(e)) => bail!(e),
            Some(_) => {}
            None => bail!("the engine stopped before the request ended"),
        }
    }
}

/// ROUGE-L F1 of `candidate` against `reference`: the longest common subsequence of their
/// lowercase words.
fn rouge_l(candidate: &str, reference: &str) -> f64 {
    let words = |s: &str| -> Vec<String> {
        s.split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
            .map(str::to_lowercase)
            .collect()
    };
    let (c, r) = (words(candidate), words(reference));
    if c.is_empty() || r.is_empty() {
        return if c == r { 1.0 } else { 0.0 };
    }
    let mut prev = vec![0usize; r.len() + 1];
    for cw in &c {
        let mut row = vec![0usize; r.len() + 1];
        for (j, rw) in r.iter().enumerate() {
            row[j + 1] = if cw == rw {
                prev[j] + 1
            } else {
                row[j].max(prev[j + 1])
            };
        }
        prev = row;
    }
    let lcs = prev[r.len()] as f64;
    let (p, q) = (lcs / c.len() as f64, lcs / r.len() as f64);
    if lcs == 0.0 {
        0.0
    } else {
        2.0 * p * q / (p + q)
    }
}

/// The first `limit` bytes of the text file `path`, cut back to a whole character.
fn read_head(path: &std::path::Path, limit: u64) -> Result<String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(limit).read_to_end(&mut bytes))
        .with_context(|| format!("cannot read {}", path.display()))?;
    match String::from_utf8(bytes) {
        Ok(text) => Ok(text),
        // A character cut by the limit is dropped; invalid bytes before it are an error.
        Err(e) if e.utf8_error().error_len().is_none() => {
            let valid = e.utf8_error().valid_up_to();
            let mut bytes = e.into_bytes();
            bytes.truncate(valid);
            Ok(String::from_utf8(bytes).expect("valid up to here"))
        }
        Err(e) => bail!(
            "{} is not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::rouge_l;

    #[test]
    fn rouge_l_is_the_lcs_f1_of_words() {
        assert_eq!(rouge_l("the cat sat", "the cat sat"), 1.0);
        assert_eq!(rouge_l("a b", "c d"), 0.0);
        // LCS "the sat" = 2 of 3 and 2 of 4 words: F1 = 2 * (2/3) * (1/2) / (2/3 + 1/2).
        let f = rouge_l("The cat sat", "the dog, sat down");
        assert!((f - 4.0 / 7.0).abs() < 1e-12, "{f}");
    }
}
