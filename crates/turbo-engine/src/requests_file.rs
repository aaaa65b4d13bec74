//! Requests files (`turbo generate --prompts-file`): one JSON object a line. Each line is parsed
//! on its own, so that one malformed line fails alone, with its line number, and the others run.

use serde::Deserialize;

/// One request of a requests file. Fields left out take the command's flags.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RequestLine {
    pub prompt: String,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub seed: Option<u64>,
    /// A session the request runs in (its KV stays resident for the next request of it).
    pub session: Option<String>,
    /// KV eviction policy of this request (`full`, `keyformer`, `h2o`, `window`, `sink`).
    pub kv_policy: Option<String>,
    /// Keys kept, as a fraction of the prompt.
    pub kv_budget: Option<f64>,
    /// Keys kept, as a count.
    pub kv_budget_tokens: Option<usize>,
}

/// A line of a requests file that holds something: its 1-based number and what it says.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedLine {
    pub number: usize,
    pub request: Result<RequestLine, String>,
}

/// The requests of a file's bytes, one per line that is not blank, each parsed alone: invalid
/// UTF-8, malformed JSON, unknown fields and values of the wrong type fail only their line.
/// Lines end with `\n` (a trailing `\r` is dropped).
pub fn parse_requests(bytes: &[u8]) -> Vec<ParsedLine> {
    // A UTF-8 byte-order mark (editors on Windows write one) is not part of the first line.
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    bytes
        .split(|&b| b == b'\n')
        .enumerate()
        .filter(|(_, line)| !line.iter().all(u8::is_ascii_whitespace))
        .map(|(i, line)| ParsedLine {
            number: i + 1,
            request: parse_line(line.strip_suffix(b"\r").unwrap_or(line)),
        })
        .collect()
}

fn parse_line(line: &[u8]) -> Result<RequestLine, String> {
    let text = std::str::from_utf8(line).map_err(|e| {
        format!(
            "not UTF-8 text (invalid byte at column {})",
            e.valid_up_to() + 1
        )
    })?;
    let request: RequestLine =
        serde_json::from_str(text).map_err(|e| format!("not a request object: {e}"))?;
    if let Some(t) = request.temperature {
        if !t.is_finite() || t < 0.0 {
            return Err(format!("temperature must be a number >= 0, not {t}"));
        }
    }
    if let Some(f) = request.kv_budget {
        if !f.is_finite() {
            return Err(format!("kv_budget must be a finite number, not {f}"));
        }
    }
    Ok(request)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_byte_order_mark_is_not_part_of_the_first_line() {
        let parsed = parse_requests(b"\xEF\xBB\xBF{\"prompt\": \"a\"}\n{\"prompt\": \"b\"}\n");
        assert_eq!(parsed.len(), 2);
        assert_eq!(parsed[0].number, 1);
        assert_eq!(parsed[0].request.as_ref().unwrap().prompt, "a");
    }

    #[test]
    fn each_line_fails_alone_with_its_number() {
        let file = b"{\"prompt\": \"a\"}\n\n  \n{\"prompt\": 3}\n{\"prompt\": \"b\", \"max_tokens\": 2}\r\n\xff\n{\"prompt\": \"c\", \"top_q\": 1}\n{";
        let parsed = parse_requests(file);
        let numbers: Vec<usize> = parsed.iter().map(|p| p.number).collect();
        assert_eq!(numbers, [1, 4, 5, 6, 7, 8]);
        assert_eq!(parsed[0].request.as_ref().unwrap().prompt, "a");
        assert!(parsed[1]
            .request
            .as_ref()
            .unwrap_err()
            .contains("invalid type"));
        assert_eq!(parsed[2].request.as_ref().unwrap().max_tokens, Some(2));
        assert!(parsed[3]
            .request
            .as_ref()
            .unwrap_err()
            .contains("not UTF-8"));
        assert!(parsed[4].request.as_ref().unwrap_err().contains("top_q"));
        assert!(parsed[5].request.as_ref().unwrap_err().contains("EOF"));
    }

    #[test]
    fn nonsense_numbers_are_refused() {
        let parsed = parse_requests(b"{\"prompt\": \"a\", \"temperature\": -1}");
        assert!(parsed[0]
            .request
            .as_ref()
            .unwrap_err()
            .contains("temperature"));
        let parsed = parse_requests(b"{\"prompt\": \"a\", \"max_tokens\": -1}");
        assert!(parsed[0].request.is_err());
        let parsed = parse_requests(b"{\"prompt\": \"a\", \"seed\": 1e400}");
        assert!(parsed[0].request.is_err());
    }
}
