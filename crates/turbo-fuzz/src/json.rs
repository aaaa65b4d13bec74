//! Structural mutations of JSON documents (`config.json`, safetensors headers, `tokenizer.json`,
//! request lines): a value replaced by an extreme number or one of the wrong type, a key removed,
//! added or renamed, arrays cut or grown; then, sometimes, mutations of the text itself that
//! `serde_json::Value` cannot hold (`NaN`, `1e400`, duplicate keys, deep nesting, truncation).

use crate::mutate::interesting_u64;
use crate::rng::Rng;
use serde_json::{json, Map, Number, Value};

/// Numbers at which a count, dimension or float stops making sense.
pub fn extreme_number(rng: &mut Rng) -> Value {
    match rng.below(12) {
        0 => json!(0),
        1 => json!(-1),
        2 => json!(1u64 << 31),
        3 => json!(1u64 << 32),
        4 => json!(1u64 << 62),
        5 => json!(u64::MAX),
        6 => json!(i64::MIN),
        7 => json!(1e308),
        8 => json!(*rng.pick(&[-1e308, 5e-324, 0.5, -0.0, 1.5, 1e19, 3.4e38, 1e-30])),
        9 => json!((interesting_u64(rng) as i64).wrapping_neg()),
        10 => json!(i32::MAX),
        _ => json!(interesting_u64(rng)),
    }
}

/// A value of any JSON type, extreme where it can be.
pub fn extreme_value(rng: &mut Rng) -> Value {
    match rng.below(16) {
        0..=5 => extreme_number(rng),
        6 => json!(*rng.pick(&[
            "NaN",
            "nan",
            "Infinity",
            "-Infinity",
            "1e400",
            "",
            "12",
            "0x10",
            "null",
            "llama",
            "default",
            "linear",
            "llama3",
            "dynamic",
            "yarn",
            "\u{1b}[31mred\u{7}",
            "\u{0}",
            "é\u{301}",
            "<|im_end|>",
        ])),
        7 => json!(rng.bool()),
        8 => Value::Null,
        9 => json!([]),
        10 => json!({}),
        11 => json!([extreme_number(rng), extreme_number(rng)]),
        12 => rope_object(rng),
        13 => json!("x".repeat(rng.small(5000))),
        14 => json!([[[[extreme_number(rng)]]]]),
        _ => json!({ "content": extreme_value_flat(rng) }),
    }
}

fn extreme_value_flat(rng: &mut Rng) -> Value {
    match rng.below(3) {
        0 => extreme_number(rng),
        1 => json!("<|im_end|>"),
        _ => Value::Null,
    }
}

/// A RoPE scaling object of a known or unknown kind, with some fields extreme or missing.
pub fn rope_object(rng: &mut Rng) -> Value {
    let kind = *rng.pick(&[
        "llama3", "linear", "default", "dynamic", "yarn", "longrope", "", "LLAMA3",
    ]);
    let mut obj = Map::new();
    let key = if rng.one_in(4) { "type" } else { "rope_type" };
    if !rng.one_in(8) {
        obj.insert(key.into(), json!(kind));
    }
    let fields: &[(&str, f64)] = &[
        ("factor", 8.0),
        ("low_freq_factor", 1.0),
        ("high_freq_factor", 4.0),
        ("original_max_position_embeddings", 8192.0),
        ("rope_theta", 500000.0),
    ];
    for &(name, normal) in fields {
        match rng.below(4) {
            0 => {}
            1 => {
                obj.insert(name.into(), extreme_value(rng));
            }
            _ => {
                obj.insert(name.into(), json!(normal));
            }
        }
    }
    Value::Object(obj)
}

/// One step on a path from the root to a value.
#[derive(Clone, Debug)]
enum Step {
    Key(String),
    Index(usize),
}

/// Paths of every value in `v`, root first, at most `cap` of them.
fn paths(v: &Value, cap: usize) -> Vec<Vec<Step>> {
    let mut out = vec![Vec::new()];
    let mut i = 0;
    while i < out.len() && out.len() < cap {
        let path = out[i].clone();
        if let Some(node) = get(v, &path) {
            match node {
                Value::Object(m) => {
                    for k in m.keys() {
                        let mut p = path.clone();
                        p.push(Step::Key(k.clone()));
                        out.push(p);
                    }
                }
                Value::Array(a) => {
                    for j in 0..a.len() {
                        let mut p = path.clone();
                        p.push(Step::Index(j));
                        out.push(p);
                    }
                }
                _ => {}
            }
        }
        i += 1;
    }
    out.truncate(cap);
    out
}

fn get<'a>(v: &'a Value, path: &[Step]) -> Option<&'a Value> {
    path.iter().try_fold(v, |v, s| match s {
        Step::Key(k) => v.get(k),
        Step::Index(i) => v.get(i),
    })
}

fn get_mut<'a>(v: &'a mut Value, path: &[Step]) -> Option<&'a mut Value> {
    path.iter().try_fold(v, |v, s| match s {
        Step::Key(k) => v.get_mut(k),
        Step::Index(i) => v.get_mut(*i),
    })
}

/// Keys a mutation may add to objects: the keys the document's reader knows, so that a
/// "missing" key can come back with the wrong value.
pub type Keys<'a> = &'a [&'a str];

/// Applies one structural mutation at a random place in `v`.
pub fn mutate_value(v: &mut Value, rng: &mut Rng, keys: Keys) {
    let all = paths(v, 4096);
    let path = rng.pick(&all).clone();
    let Some(node) = get_mut(v, &path) else {
        return;
    };
    match rng.below(12) {
        0..=3 => *node = extreme_value(rng),
        4 => {
            // Remove from the parent (a missing key or a shorter array).
            if let Some((last, parent_path)) = path.split_last() {
                if let Some(parent) = get_mut(v, parent_path) {
                    match (parent, last) {
                        (Value::Object(m), Step::Key(k)) => {
                            m.remove(k);
                        }
                        (Value::Array(a), Step::Index(i)) if *i < a.len() => {
                            a.remove(*i);
                        }
                        _ => {}
                    }
                }
            }
        }
        5 => match node {
            Value::Object(m) => {
                let key = if !keys.is_empty() && rng.bool() {
                    rng.pick(keys).to_string()
                } else {
                    rng.pick(&["", "__metadata__", "x", "dtype", "shape", "\u{0}"])
                        .to_string()
                };
                m.insert(key, extreme_value(rng));
            }
            Value::Array(a) => {
                let at = rng.position(a.len());
                let item = match a.first() {
                    Some(first) if rng.bool() => first.clone(),
                    _ => extreme_value(rng),
                };
                a.insert(at, item);
            }
            other => *other = json!([other.clone()]),
        },
        6 => {
            // Rename a key (same value under another name).
            if let Some((Step::Key(k), parent_path)) = path.split_last() {
                if let Some(Value::Object(m)) = get_mut(v, parent_path) {
                    if let Some(val) = m.remove(k) {
                        let new = if !keys.is_empty() && rng.bool() {
                            rng.pick(keys).to_string()
                        } else {
                            format!("{k}{}", rng.pick(&["_", "0", " ", "s"]))
                        };
                        m.insert(new, val);
                    }
                }
            }
        }
        7 => {
            if let Value::Array(a) = node {
                match rng.below(3) {
                    0 => a.truncate(rng.small(a.len())),
                    1 if !a.is_empty() => {
                        let i = rng.below(a.len());
                        let item = a[i].clone();
                        let n = rng.small(64).max(1);
                        for _ in 0..n {
                            a.push(item.clone());
                        }
                    }
                    _ => a.reverse(),
                }
            } else {
                *node = extreme_number(rng);
            }
        }
        8 => {
            // Numbers nudged: off by one, negated, made float, made string.
            *node = match &*node {
                Value::Number(n) => nudge(n, rng),
                Value::String(s) => match rng.below(3) {
                    0 => json!(""),
                    1 => json!(format!("{s}{s}")),
                    _ => json!(s.chars().rev().collect::<String>()),
                },
                Value::Bool(b) => json!(if rng.bool() { json!(!b) } else { json!(1) }),
                other => other.clone(),
            }
        }
        9 => *node = json!({ "value": node.clone() }),
        10 => *node = rope_object(rng),
        _ => *node = extreme_number(rng),
    }
}

fn nudge(n: &Number, rng: &mut Rng) -> Value {
    if let Some(u) = n.as_u64() {
        return match rng.below(6) {
            0 => json!(u.wrapping_add(1)),
            1 => json!(u.wrapping_sub(1)),
            2 => json!(-(u as i128).max(i64::MIN as i128) as i64),
            3 => json!(u as f64 + 0.5),
            4 => json!(u.to_string()),
            _ => json!(u.wrapping_mul(2)),
        };
    }
    if let Some(f) = n.as_f64() {
        return match rng.below(4) {
            0 => json!(-f),
            1 => json!(f * 1e30),
            2 => json!(f.to_string()),
            _ => json!(f / 1e30),
        };
    }
    json!(0)
}

/// `v` as text, compact or pretty, sometimes with mutations that only text can carry.
pub fn to_text(v: &Value, rng: &mut Rng) -> String {
    let mut text = if rng.bool() {
        v.to_string()
    } else {
        serde_json::to_string_pretty(v).unwrap_or_default()
    };
    if rng.one_in(6) {
        mutate_text(&mut text, rng);
    }
    text
}

/// Mutations of JSON text that a parsed value cannot express.
pub fn mutate_text(text: &mut String, rng: &mut Rng) {
    match rng.below(8) {
        0 => {
            // A number literal replaced by one out of range or not JSON at all.
            let starts: Vec<usize> = text
                .char_indices()
                .filter(|&(i, c)| {
                    c.is_ascii_digit()
                        && (i == 0 || !text.as_bytes()[i - 1].is_ascii_alphanumeric())
                        && text.as_bytes().get(i.wrapping_sub(1)) != Some(&b'"')
                })
                .map(|(i, _)| i)
                .collect();
            if let Some(&at) = starts.get(rng.below(starts.len().max(1))) {
                let end = text[at..]
                    .find(|c: char| !(c.is_ascii_digit() || ".eE+-".contains(c)))
                    .map_or(text.len(), |n| at + n);
                let lit = *rng.pick(&[
                    "1e400",
                    "-1e400",
                    "NaN",
                    "Infinity",
                    "-0",
                    "01",
                    "1.",
                    "18446744073709551616",
                    "-9223372036854775809",
                    "340282366920938463463374607431768211456",
                    "0.0000000000000000000000000000000000000000000000001",
                    "1E+2",
                ]);
                text.replace_range(at..end, lit);
            }
        }
        1 => {
            // A duplicate key: the first `"key": value` pair again, right after the brace.
            if let (Some(open), Some(colon)) = (text.find('{'), text.find(':')) {
                if colon > open {
                    let end = text[colon..]
                        .find([',', '}'])
                        .map_or(text.len(), |n| colon + n);
                    let pair = text[open + 1..end].to_string();
                    if !pair.trim().is_empty() {
                        text.insert_str(open + 1, &format!("{pair},"));
                    }
                }
            }
        }
        2 => {
            let depth = rng.small(100_000);
            *text = format!("{}{text}{}", "[".repeat(depth), "]".repeat(depth));
        }
        3 => {
            let at = rng.position(text.len());
            let at = floor_char_boundary(text, at);
            text.truncate(at);
        }
        4 => text.insert(0, '\u{feff}'),
        5 => text.push_str(rng.pick_str(&["x", "}", " {}", "\u{0}", "\n\n"])),
        6 => *text = text.replace(':', ": ").replace(',', " ,\n"),
        _ => {
            // A string value's content replaced by escapes and lone surrogates.
            if let Some(q) = text.find("\":\"").or_else(|| text.find("\": \"")) {
                let at = text[q + 2..].find('"').map_or(q, |n| q + 2 + n + 1);
                text.insert_str(
                    at,
                    rng.pick_str(&["\\ud800", "\\u0000", "\\udfff\\ud800", "\\\\", "\\u001b"]),
                );
            }
        }
    }
}

/// Sets the value at `path` (object keys), making objects of whatever is in the way: unlike
/// `v[key] = ...`, never panics on a value a mutation made a number or an array.
pub fn set(v: &mut Value, path: &[&str], new: Value) {
    let mut node = v;
    for key in path {
        if !node.is_object() {
            *node = Value::Object(Map::new());
        }
        node = node
            .as_object_mut()
            .expect("made an object")
            .entry(key.to_string())
            .or_insert(Value::Null);
    }
    *node = new;
}

/// The value at `path` (object keys), if every step is there.
pub fn at_mut<'a>(v: &'a mut Value, path: &[&str]) -> Option<&'a mut Value> {
    path.iter().try_fold(v, |v, key| v.get_mut(*key))
}

/// The largest char boundary of `s` at or below `at`.
pub fn floor_char_boundary(s: &str, mut at: usize) -> usize {
    at = at.min(s.len());
    while !s.is_char_boundary(at) {
        at -= 1;
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_keep_documents_printable() {
        let mut rng = Rng::new(9);
        let seed = json!({"a": 1, "b": [1, 2, {"c": "d"}], "e": {"f": null}});
        let mut differ = 0;
        for _ in 0..2000 {
            let mut v = seed.clone();
            mutate_value(&mut v, &mut rng, &["a", "z"]);
            let text = to_text(&v, &mut rng);
            differ += usize::from(serde_json::from_str::<Value>(&text).ok() != Some(seed.clone()));
        }
        assert!(differ > 1500, "{differ}");
    }
}
