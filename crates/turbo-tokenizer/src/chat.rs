//! Chat templates: renders a conversation into the prompt text a model was trained on.
//!
//! Models ship a Jinja2 template (HF `tokenizer_config.json` `chat_template`, GGUF
//! `tokenizer.chat_template`). We render it with minijinja configured like HF transformers
//! (`trim_blocks`, `lstrip_blocks`, Python string methods, `raise_exception`, HF-style
//! `tojson`) so the prompt matches `apply_chat_template` byte for byte.

use crate::contain::contained;
use crate::tokenizer::{Escaped, TextTokenizer};
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// Marks around a message's content while rendering (Unicode noncharacters: not for
/// interchange, removed from content before rendering).
const OPEN: char = '\u{FDD0}';
const CLOSE: char = '\u{FDD1}';

/// Name under which the template is stored in the environment.
const TEMPLATE_NAME: &str = "chat";

/// Instructions a template may run per render: real templates take thousands for a long
/// conversation; a template that loops without end stops within a fraction of a second.
const TEMPLATE_FUEL: u64 = 5_000_000;

/// Longest text a template may render: far past any prompt (a million tokens of text), short of
/// what the tokenizer could encode without gigabytes of scratch.
const MAX_RENDER_BYTES: usize = 8 << 20;

/// The render's output, refused past [`MAX_RENDER_BYTES`] (a template that writes in a loop).
struct BoundedOutput(Vec<u8>);

impl std::io::Write for BoundedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_RENDER_BYTES {
            return Err(std::io::Error::other(format!(
                "the rendered prompt is longer than {MAX_RENDER_BYTES} bytes"
            )));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Widest indent `tojson` and `indent` write (templates use 2 or 4).
const MAX_JSON_INDENT: usize = 64;

/// ChatML, used by models that ship no template (and natively by Qwen, SmolLM, ...).
const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Errors from compiling or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The template source is not valid Jinja (for minijinja).
    #[error("failed to compile chat template: {}", Escaped(.0))]
    Compile(Error),
    /// Rendering failed, including `raise_exception(...)` called by the template
    /// (e.g. "conversation roles must alternate").
    #[error("failed to render chat template: {}", Escaped(.0))]
    Render(Error),
    /// The template cut a message's content apart, so it cannot be kept apart from the markup.
    #[error("the chat template transforms message content; it cannot be kept apart from the template's special tokens")]
    Content,
    /// The template engine failed on the template (a bug of minijinja's that a hostile
    /// template reaches), contained.
    #[error("the chat template cannot be rendered: {}", Escaped(.0))]
    Panic(String),
    /// Encoding the rendered text failed.
    #[error("failed to encode the chat prompt: {}", Escaped(.0))]
    Encode(String),
    /// The template rendered the conversation as no text at all (an empty template, or one
    /// that ignores the messages it is given): there is no prompt to run.
    #[error("the model's chat template renders the messages as empty text")]
    Empty,
}

/// One message of a conversation (`role` is "system", "user", "assistant", ...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template plus the special-token strings templates refer to.
///
/// Compiled once at model load so that per-request rendering only evaluates.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source`. `bos_token`/`eos_token` are the token *strings* (e.g.
    /// "<|begin_of_text|>"), exposed to the template as `bos_token` / `eos_token` like HF does.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        // Python str/dict methods (.strip(), .startswith(), .items(), ...) used by HF templates.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // HF transformers renders with trim_blocks=True, lstrip_blocks=True.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_filter("format", bounded_format);
        env.add_filter("indent", bounded_indent);
        env.add_filter("list", bounded_list);
        // `{{ seq }}` renders a whole sequence in one step, which fuel does not see: a repeated
        // one (`[1, 2] * 10**18`) is refused by its length instead.
        env.set_formatter(|out, state, value| {
            if value.len().is_some_and(|n| n > MAX_RENDERED_ITEMS) {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("a value of more than {MAX_RENDERED_ITEMS} items in the output"),
                ));
            }
            minijinja::escape_formatter(out, state, value)
        });
        // A template comes from a model file: its loops are bounded by fuel, not by trust.
        env.set_fuel(Some(TEMPLATE_FUEL));
        let compiled = contained(|| env.add_template_owned(TEMPLATE_NAME, source.to_string()));
        compiled
            .map_err(ChatError::Panic)?
            .map_err(ChatError::Compile)?;
        Ok(Self {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The ChatML template (`<|im_start|>role\ncontent<|im_end|>\n` per message, then
    /// `<|im_start|>assistant\n` for the generation prompt): the fallback for models that
    /// ship no chat template.
    /// The template a model ships (`source`), with the model's BOS and EOS token texts, or ChatML
    /// when it ships none.
    pub fn for_model(
        source: Option<&str>,
        tokenizer: &crate::tokenizer::TextTokenizer,
    ) -> Result<Self, ChatError> {
        let name = |id: Option<u32>| {
            id.and_then(|id| tokenizer.id_to_token(id))
                .unwrap_or_default()
        };
        match source {
            Some(src) => Self::new(
                src,
                &name(tokenizer.bos_id()),
                &name(tokenizer.eos_ids().first().copied()),
            ),
            None => Ok(Self::chatml()),
        }
    }

    pub fn chatml() -> Self {
        // The source is a constant covered by tests, so compiling it cannot fail at runtime.
        Self::new(CHATML_TEMPLATE, "", "<|im_end|>").expect("built-in ChatML template compiles")
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends with the header that
    /// makes the model answer as the assistant.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(ChatError::Render)?;
        let mut out = BoundedOutput(Vec::new());
        let rendered = contained(|| {
            tmpl.render_captured_to(
                context! {
                    messages => messages,
                    add_generation_prompt => add_generation_prompt,
                    bos_token => self.bos_token.as_str(),
                    eos_token => self.eos_token.as_str(),
                },
                &mut out,
            )
        });
        rendered
            .map_err(ChatError::Panic)?
            .map_err(ChatError::Render)?;
        String::from_utf8(out.0).map_err(|_| ChatError::Panic("the output is not UTF-8".into()))
    }

    /// Renders `messages` and encodes the text with `tokenizer`, the messages' content as
    /// untrusted text ([`TextTokenizer::encode_untrusted`]): a special token's text typed in a
    /// message stays text, so only the template's own markup makes special tokens.
    ///
    /// The content is located by rendering each message with marks around it (Unicode
    /// noncharacters, stripped from the content first); whitespace at its ends stays outside
    /// the marks, so a template's `trim` acts as on the bare text and the rendered text is the
    /// one [`ChatTemplate::render`] gives. A template that cuts a message's content apart
    /// (the marks come out unpaired) is an error rather than a prompt whose user text might
    /// hold special tokens.
    pub fn encode(
        &self,
        tokenizer: &TextTokenizer,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, ChatError> {
        let (text, content) = self.render_marked(messages, add_generation_prompt)?;
        // A template that looks at the content (`startswith`, `length`, a comparison) sees the
        // marks, and may then render other text than the model is meant to get: the real text
        // is the unmarked render, with each message's content found in it in order.
        let unmarked: Vec<ChatMessage> = messages
            .iter()
            .map(|m| ChatMessage {
                role: m.role.clone(),
                content: m
                    .content
                    .chars()
                    .filter(|&c| c != OPEN && c != CLOSE)
                    .collect(),
            })
            .collect();
        let plain = self.render(&unmarked, add_generation_prompt)?;
        let (text, content) = match plain == text {
            true => (text, content),
            false => {
                let found = find_contents(&plain, &unmarked).ok_or(ChatError::Content)?;
                (plain, found)
            }
        };
        if text.is_empty() {
            return Err(ChatError::Empty);
        }
        tokenizer
            .encode_untrusted(&text, &content)
            .map_err(|e| ChatError::Encode(e.to_string()))
    }

    /// The rendered text and the byte ranges of the messages' content in it.
    fn render_marked(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<(String, Vec<Range<usize>>), ChatError> {
        let marked: Vec<ChatMessage> = messages
            .iter()
            .map(|m| {
                let c: String = m
                    .content
                    .chars()
                    .filter(|&ch| ch != OPEN && ch != CLOSE)
                    .collect();
                let start = c.len() - c.trim_start().len();
                let end = start + c.trim().len();
                ChatMessage {
                    role: m.role.clone(),
                    content: format!(
                        "{}{OPEN}{}{CLOSE}{}",
                        &c[..start],
                        &c[start..end],
                        &c[end..]
                    ),
                }
            })
            .collect();
        let raw = self.render(&marked, add_generation_prompt)?;
        let mut text = String::with_capacity(raw.len());
        let mut content = Vec::new();
        let mut open: Option<usize> = None;
        let unpaired = || ChatError::Content;
        for ch in raw.chars() {
            match ch {
                OPEN if open.is_none() => open = Some(text.len()),
                CLOSE => content.push(open.take().ok_or_else(unpaired)?..text.len()),
                OPEN => return Err(unpaired()),
                _ => text.push(ch),
            }
        }
        if open.is_some() {
            return Err(unpaired());
        }
        Ok((text, content))
    }

    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }
}

/// The byte ranges of each message's content (trimmed, as the marks are placed) in `text`,
/// searched in order; `None` when one is not there as it was sent.
fn find_contents(text: &str, messages: &[ChatMessage]) -> Option<Vec<Range<usize>>> {
    let mut from = 0;
    let mut found = Vec::new();
    for m in messages {
        let c = m.content.trim();
        if c.is_empty() {
            continue;
        }
        let at = from + text[from..].find(c)?;
        found.push(at..at + c.len());
        from = at + c.len();
    }
    Some(found)
}

/// `raise_exception(msg)`: HF templates call this to reject invalid conversations.
fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// minijinja's `format` filter (printf-style), refusing field widths and precisions past
/// [`MAX_FORMAT_WIDTH`]: a width is allocated as padding at once.
fn bounded_format(
    state: &minijinja::State,
    format_str: &Value,
    args: minijinja::value::Rest<Value>,
) -> Result<Value, Error> {
    if let Some(spec) = format_str.as_str() {
        let widest = spec
            .split(|c: char| !c.is_ascii_digit())
            .filter(|d| !d.is_empty())
            .map(|d| d.parse::<u64>().unwrap_or(u64::MAX))
            .max();
        if widest.is_some_and(|w| w > MAX_FORMAT_WIDTH) {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("format: a width of more than {MAX_FORMAT_WIDTH}"),
            ));
        }
    }
    minijinja::filters::format(state, format_str, args)
}

/// minijinja's `indent` filter, refusing widths past [`MAX_JSON_INDENT`] (each line gets that
/// many spaces).
fn bounded_indent(
    value: minijinja::value::StringInput<'_>,
    width: Option<usize>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let asked = match width {
        Some(w) => Some(w),
        None => kwargs.get::<Option<usize>>("width")?,
    };
    if asked.is_some_and(|w| w > MAX_JSON_INDENT) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("indent: a width of more than {MAX_JSON_INDENT}"),
        ));
    }
    minijinja::filters::indent(value, width, first, blank, kwargs)
}

/// minijinja's `list` filter, refusing a sequence of more than [`MAX_RENDERED_ITEMS`] items (a
/// repeated one is materialised at once).
fn bounded_list(state: &minijinja::State, value: Value) -> Result<Value, Error> {
    if value.len().is_some_and(|n| n > MAX_RENDERED_ITEMS) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("list: more than {MAX_RENDERED_ITEMS} items"),
        ));
    }
    minijinja::filters::list(state, value)
}

/// Most items of one sequence or map a template may write out at once.
/// Most items (characters of a string, elements of a list) one value may put into a rendered
/// prompt: a template is refused past it (see [`ChatTemplate::new`]).
pub const MAX_RENDERED_ITEMS: usize = 1 << 20;

/// Widest field `format` pads to.
const MAX_FORMAT_WIDTH: u64 = 1024;

/// HF's `tojson` (Python `json.dumps(x, ensure_ascii=False, indent=indent)`): unlike
/// minijinja's built-in it neither HTML-escapes nor drops the ", "/": " separators, both of
/// which would change the prompt (tool definitions) relative to what the model was trained on.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    if indent.is_some_and(|n| n > MAX_JSON_INDENT) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: an indent of more than {MAX_JSON_INDENT} spaces"),
        ));
    }
    let mut out = String::new();
    write_json(value, indent, 0, &mut out)?;
    Ok(Value::from(out))
}

fn write_json(
    v: &Value,
    indent: Option<usize>,
    level: usize,
    out: &mut String,
) -> Result<(), Error> {
    let to_json_err = |e: serde_json::Error| Error::new(ErrorKind::InvalidOperation, e.to_string());
    // Python: (", ", ": ") without indent, (",", ": ") plus newlines with indent.
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::String => out
            .push_str(&serde_json::to_string(v.as_str().unwrap_or_default()).map_err(to_json_err)?),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, level + 1);
                write_json(item, indent, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, level + 1);
                let k = match key.as_str() {
                    Some(s) => s.to_string(),
                    None => key.to_string(),
                };
                out.push_str(&serde_json::to_string(&k).map_err(to_json_err)?);
                out.push_str(": ");
                write_json(&v.get_item(key)?, indent, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        // Numbers and anything else: serde's representation.
        _ => out.push_str(&serde_json::to_string(v).map_err(to_json_err)?),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' reference ids/renderings; `SMOLLM2_TOKENIZER_GOLDEN` overrides the path.
    fn golden_path() -> std::path::PathBuf {
        match std::env::var_os("SMOLLM2_TOKENIZER_GOLDEN") {
            Some(p) => p.into(),
            None => std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/golden/smollm2_tokenizer.json"),
        }
    }

    const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    const SMOL_SYSTEM: &str = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";

    fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
        pairs
            .iter()
            .map(|(r, c)| ChatMessage::new(*r, *c))
            .collect()
    }

    #[test]
    fn smollm2_template() {
        let t = ChatTemplate::new(SMOLLM2_TEMPLATE, "<|im_start|>", "<|im_end|>").unwrap();
        let one = msgs(&[("user", "What is the capital of France?")]);
        assert_eq!(
            t.render(&one, true).unwrap(),
            format!("{SMOL_SYSTEM}<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
        );
        assert_eq!(
            t.render(&one, false).unwrap(),
            format!("{SMOL_SYSTEM}<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")
        );
        let two = msgs(&[
            ("user", "Hi!"),
            ("assistant", "Hello! How can I help?"),
            ("user", "Tell me a joke."),
        ]);
        assert_eq!(
            t.render(&two, true).unwrap(),
            format!(
                "{SMOL_SYSTEM}<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>\n<|im_start|>user\nTell me a joke.<|im_end|>\n<|im_start|>assistant\n"
            )
        );
        let sys = msgs(&[
            ("system", "You are a concise math tutor."),
            ("user", "What is 7 times 8?"),
        ]);
        assert_eq!(
            t.render(&sys, true).unwrap(),
            "<|im_start|>system\nYou are a concise math tutor.<|im_end|>\n<|im_start|>user\nWhat is 7 times 8?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn llama3_style_template() {
        let src = "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'].strip() + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
        let t = ChatTemplate::new(src, "<|begin_of_text|>", "<|eot_id|>").unwrap();
        let m = msgs(&[("system", "  Be brief.\n"), ("user", "Hi there ")]);
        assert_eq!(
            t.render(&m, true).unwrap(),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        // The `| trim` filter and .startswith() work as well.
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}{% if m.content.startswith('/') %}cmd{% endif %}[{{ m.content | trim }}]{% endfor %}{{ eos_token }}",
            "<s>",
            "</s>",
        )
        .unwrap();
        assert_eq!(
            t.render(&msgs(&[("user", " /x ")]), false).unwrap(),
            "<s>[/x]</s>"
        );
    }

    #[test]
    fn trim_and_lstrip_blocks_like_hf() {
        let src = "{% for message in messages %}\n    {% if message.role == 'user' %}\nUser: {{ message.content }}\n    {% else %}\nBot: {{ message.content }}\n    {% endif %}\n{% endfor %}\n";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let m = msgs(&[("user", "hi"), ("assistant", "yo")]);
        assert_eq!(t.render(&m, false).unwrap(), "User: hi\nBot: yo\n");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with the user') }}{% endif %}ok";
        let t = ChatTemplate::new(src, "", "").unwrap();
        assert_eq!(t.render(&msgs(&[("user", "a")]), false).unwrap(), "ok");
        let e = t.render(&msgs(&[("assistant", "a")]), false).unwrap_err();
        assert!(matches!(e, ChatError::Render(_)));
        assert!(
            e.to_string()
                .contains("Conversation must start with the user"),
            "{e}"
        );
    }

    #[test]
    fn compile_error() {
        let e = ChatTemplate::new("{% for m in messages %}", "", "").unwrap_err();
        assert!(matches!(e, ChatError::Compile(_)), "{e}");
    }

    #[test]
    fn chatml_fallback() {
        let t = ChatTemplate::chatml();
        let m = msgs(&[("system", "S"), ("user", "U")]);
        assert_eq!(
            t.render(&m, true).unwrap(),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(t.render(&[], false).unwrap(), "");
    }

    #[test]
    fn tojson_matches_python() {
        let t = ChatTemplate::new(
            "{{ messages[0].content | tojson }}|{{ [1, 'a<b', none, true, {}] | tojson }}|{{ {'k': [1, 2]} | tojson(indent=2) }}",
            "",
            "",
        )
        .unwrap();
        let out = t.render(&msgs(&[("user", "é\"\n")]), false).unwrap();
        assert_eq!(
            out,
            "\"é\\\"\\n\"|[1, \"a<b\", null, true, {}]|{\n  \"k\": [\n    1,\n    2\n  ]\n}"
        );
    }

    /// Compares with transformers' `apply_chat_template` output when the golden file exists.
    #[test]
    fn smollm2_golden_chat() {
        let path = golden_path();
        let Ok(text) = std::fs::read_to_string(&path) else {
            eprintln!("skipping: {} not found", path.display());
            return;
        };
        let j: serde_json::Value = serde_json::from_str(&text).unwrap();
        let (Some(src), Some(cases)) = (j["chat_template"].as_str(), j["chat_rendered"].as_array())
        else {
            eprintln!(
                "skipping: no chat_template/chat_rendered in {}",
                path.display()
            );
            return;
        };
        let t = ChatTemplate::new(
            src,
            j["bos_token"].as_str().unwrap_or(""),
            j["eos_token"].as_str().unwrap_or(""),
        )
        .unwrap();
        for c in cases {
            let m: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
            assert_eq!(
                t.render(&m, true).unwrap(),
                c["rendered"].as_str().unwrap(),
                "{}",
                c["name"]
            );
        }
    }
}
