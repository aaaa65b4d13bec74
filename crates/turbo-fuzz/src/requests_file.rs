//! The requests-file target: a file's bytes through
//! [`turbo_engine::requests_file::parse_requests`]. Beyond not panicking, it must return exactly
//! one entry per line that is not blank (ASCII whitespace only), numbered from 1 by its place in
//! the file; an accepted request must be a JSON object with a string `prompt` and only known
//! fields, with a temperature that is a number at least 0 and a finite `kv_budget`.

use crate::json::{extreme_number, extreme_value, mutate_value, to_text};
use crate::rng::Rng;
use serde_json::{json, Value};
use turbo_engine::requests_file::parse_requests;

/// The fields a request line may have.
const FIELDS: &[&str] = &[
    "prompt",
    "max_tokens",
    "temperature",
    "seed",
    "session",
    "kv_policy",
    "kv_budget",
    "kv_budget_tokens",
];

/// A line is blank when it holds nothing but these (what `u8::is_ascii_whitespace` accepts,
/// spelled out so that the check does not share the parser's definition).
fn blank(line: &[u8]) -> bool {
    line.iter()
        .all(|b| matches!(b, b' ' | b'\t' | b'\r' | b'\n' | b'\x0c'))
}

/// The target.
pub fn run(data: &[u8]) {
    let parsed = parse_requests(data);
    if parsed.iter().any(|p| p.request.is_ok()) {
        crate::accept();
    }
    // A UTF-8 byte-order mark before the first line is not part of it.
    let data = data.strip_prefix(&[0xEF, 0xBB, 0xBF]).unwrap_or(data);
    let lines: Vec<&[u8]> = data.split(|&b| b == b'\n').collect();
    let expected: Vec<usize> = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| !blank(l))
        .map(|(i, _)| i + 1)
        .collect();
    let numbers: Vec<usize> = parsed.iter().map(|p| p.number).collect();
    assert_eq!(
        numbers, expected,
        "one entry per non-blank line, numbered from 1"
    );
    for p in &parsed {
        let line = lines[p.number - 1];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        match &p.request {
            Ok(r) => {
                let v: Value = serde_json::from_slice(line)
                    .unwrap_or_else(|e| panic!("line {} accepted but is not JSON: {e}", p.number));
                let obj = v
                    .as_object()
                    .unwrap_or_else(|| panic!("line {} accepted but not an object", p.number));
                assert!(
                    obj.keys().all(|k| FIELDS.contains(&k.as_str())),
                    "line {} accepted with an unknown field",
                    p.number
                );
                assert_eq!(
                    obj.get("prompt").and_then(Value::as_str),
                    Some(r.prompt.as_str())
                );
                if let Some(t) = r.temperature {
                    assert!(t.is_finite() && t >= 0.0, "temperature {t} accepted");
                }
                if let Some(b) = r.kv_budget {
                    assert!(b.is_finite(), "kv_budget {b} accepted");
                }
            }
            Err(message) => {
                assert!(!message.is_empty());
            }
        }
    }
}

fn seed_line(rng: &mut Rng) -> Value {
    let mut v = json!({ "prompt": crate::text::generate(rng, &["<|im_end|>".to_string()], 4) });
    for &f in &FIELDS[1..] {
        if rng.one_in(3) {
            v[f] = match f {
                "max_tokens" | "kv_budget_tokens" | "seed" => json!(rng.below(1000)),
                "temperature" | "kv_budget" => json!(rng.below(100) as f64 / 50.0),
                "kv_policy" => json!(*rng.pick(&["full", "keyformer", "h2o", "window", "sink"])),
                _ => json!(format!("s{}", rng.below(4))),
            };
        }
    }
    v
}

/// One line: a request, sometimes mutated as JSON or as text, or a line of another kind.
fn line(rng: &mut Rng) -> Vec<u8> {
    match rng.below(20) {
        0 => Vec::new(),
        1 => rng
            .pick(&[
                " ", "\t", "\r", " \r", "\x0c", "\x0b", "\u{a0}", "\u{feff}", "\0",
            ])
            .as_bytes()
            .to_vec(),
        2 => crate::mutate::invalid_utf8(rng),
        3 => rng
            .pick(&[
                "{",
                "}",
                "[]",
                "null",
                "\"prompt\"",
                "{\"prompt\": \"a\"} {\"prompt\": \"b\"}",
                "{\"prompt\": \"a\", \"prompt\": \"b\"}",
                "{\"prompt\": \"a\"}\r\r",
                "\u{feff}{\"prompt\": \"a\"}",
                "{\"prompt\": \"\\ud800\"}",
                "{\"prompt\": \"a\", \"temperature\": NaN}",
                "{\"prompt\": \"a\", \"kv_budget\": 1e400}",
                "{\"prompt\": \"a\", \"max_tokens\": 18446744073709551616}",
                "{\"prompt\": \"a\", \"temperature\": -0.0}",
                "{\"prompt\": \"a\", \"temperature\": 1e39}",
            ])
            .as_bytes()
            .to_vec(),
        4 => {
            let depth = rng.small(1000);
            format!("{}{}", "[".repeat(depth), "]".repeat(depth)).into_bytes()
        }
        5 => json!({ "prompt": "x".repeat(rng.small(200_000)) })
            .to_string()
            .into_bytes(),
        _ => {
            let mut v = seed_line(rng);
            if rng.bool() {
                match rng.below(3) {
                    0 => v[*rng.pick(FIELDS)] = extreme_number(rng),
                    1 => v[*rng.pick(FIELDS)] = extreme_value(rng),
                    _ => mutate_value(&mut v, rng, FIELDS),
                }
            }
            // One line: pretty printing would spread the object over several.
            to_text(&v, rng).replace('\n', " ").into_bytes()
        }
    }
}

/// A case: lines joined by `\n` or `\r\n`, sometimes without a final newline, sometimes with
/// bytes mutated.
pub fn generate(rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..rng.small(12) {
        if i > 0 {
            out.extend_from_slice(if rng.one_in(4) { b"\r\n" } else { b"\n" });
        }
        out.extend(line(rng));
    }
    if rng.bool() {
        out.push(b'\n');
    }
    if rng.one_in(6) {
        crate::mutate::bytes(&mut out, rng, 3, &[]);
    }
    out
}

/// Mutates an input of the target (libFuzzer's custom mutator): a line added or changed.
pub fn mutate(data: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut lines: Vec<Vec<u8>> = data.split(|&b| b == b'\n').map(<[u8]>::to_vec).collect();
    let i = rng.below(lines.len());
    match rng.below(3) {
        0 => lines.insert(i, line(rng)),
        1 => lines[i] = line(rng),
        _ => crate::mutate::bytes(&mut lines[i], rng, 3, &[]),
    }
    lines.join(&b'\n')
}

/// Unmutated seeds, for a libFuzzer corpus.
pub fn seeds() -> Vec<Vec<u8>> {
    vec![
        b"{\"prompt\": \"Hello\"}\n{\"prompt\": \"Hi\", \"max_tokens\": 8, \"temperature\": 0.7, \"seed\": 1}\n".to_vec(),
        b"\n  \n{\"prompt\": \"a\", \"session\": \"s\", \"kv_policy\": \"keyformer\", \"kv_budget\": 0.5}\r\n{\"prompt\": \"b\", \"kv_budget_tokens\": 64}".to_vec(),
    ]
}
