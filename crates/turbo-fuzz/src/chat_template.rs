//! The chat template target: a template source compiled by [`ChatTemplate::new`], a
//! conversation of arbitrary roles and contents rendered by [`ChatTemplate::render`] and encoded
//! by [`ChatTemplate::encode`]. Any of them may fail, none may panic, hang or allocate without
//! bound; and where encoding succeeds its tokens decode to the rendered text, which is what
//! `encode` promises (its content marks must not change what the template renders).
//!
//! An input is its parts separated by `0xFF` (a byte UTF-8 never holds): a flags byte (bit 0:
//! add the generation prompt; bits 1-2: which tokenizer), then the template source, the BOS and
//! EOS texts, and the messages' roles and contents, alternately. Parts are read as lossy UTF-8.
//!
//! Sources are mutated with Jinja in mind: snippets inserted (filters, tests, loops, slices,
//! arithmetic at the integer limits, recursion, and constructs whose cost grows with a number in
//! the source), spans deleted, duplicated or swapped, integer literals made extreme.

use crate::rng::Rng;
use crate::seeds::{templates, tokenizers};
use turbo_tokenizer::{ChatMessage, ChatTemplate};

/// Separates an input's parts.
const SEP: u8 = 0xff;

/// The content marks `encode` puts around messages and removes from them first.
const MARKS: [char; 2] = ['\u{fdd0}', '\u{fdd1}'];

/// Jinja that real templates use, that breaks templates, or whose cost grows with a number.
const SNIPPETS: &[&str] = &[
    "{{ message['content'] }}",
    "{{ message.content | trim }}",
    "{{ messages[0]['content'] }}",
    "{{ messages[-1].role }}",
    "{{ messages | length }}",
    "{{ bos_token }}",
    "{{ eos_token }}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% for m in messages %}{{ m.role }}{% endfor %}",
    "{% for m in messages %}{{ loop.index }}{{ loop.previtem }}{{ loop.nextitem }}{% endfor %}",
    "{% set x = messages[1:] %}",
    "{% set ns = namespace(n=0) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}",
    "{{ raise_exception('no') }}",
    "{{ messages | tojson }}",
    "{{ messages | tojson(indent=4) }}",
    "{{ messages | tojson(indent=1000000000000) }}",
    "{{ messages | tojson(indent=18446744073709551615) }}",
    "{{ messages | tojson(indent=-1) }}",
    "{{ message.content.startswith('/') }}",
    "{{ message.content.split('</think>')[-1] }}",
    "{{ message.content.split('') }}",
    "{{ message.content.replace('', 'x') }}",
    "{{ message.content[::-1] }}",
    "{{ message.content[:3] }}",
    "{{ message.content[1000000:] }}",
    "{{ message.content[::0] }}",
    "{{ message.content | length }}",
    "{{ message.content == 'hi' }}",
    "{{ 'x' * 99999999 }}",
    "{{ 'x' * 100000000000 }}",
    "{{ [1, 2] * 1000000000000 }}",
    "{{ ([1, 2] * 1000000000000) | length }}",
    "{{ ([1, 2] * 1000000000000) | list }}",
    "{% for i in [1, 2] * 1000000000000 %}{% endfor %}",
    "{{ range(100000) | list | length }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{{ 'x' * 90000000 }}{% endfor %}",
    "{{ range(9223372036854775807) }}",
    "{{ 'x' | indent(1000000000000) }}",
    "{{ 'a\nb' | indent(100000000) }}",
    "{{ '%999999999999d' | format(1) }}",
    "{{ '%*d' | format(100000000000, 1) }}",
    "{{ 'x' | center(1000000000000) }}",
    "{{ 'x'.center(1000000000000) }}",
    "{{ 'x'.ljust(1000000000000) }}",
    "{{ 'x' | wordwrap(0) }}",
    "{{ 'x' | truncate(-1) }}",
    "{{ messages | batch(0) }}",
    "{{ messages | slice(0) }}",
    "{{ 1.5 | round(-1000) }}",
    "{{ 1.5 | round(1000000000000) }}",
    "{{ 2 ** 100000000000 }}",
    "{{ 9223372036854775807 + 1 }}",
    "{{ -9223372036854775808 // -1 }}",
    "{{ -9223372036854775808 % -1 }}",
    "{{ 1 / 0 }}",
    "{{ 1 // 0 }}",
    "{{ 1 % 0 }}",
    "{{ (-9223372036854775807 - 1) | abs }}",
    "{{ '9223372036854775808' | int }}",
    "{{ 'ff' | int(base=1) }}",
    "{{ messages[9223372036854775807] }}",
    "{{ messages[-9223372036854775808] }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
    "{% include 'chat' %}",
    "{% extends 'chat' %}",
    "{% import 'chat' as c %}",
    "{% filter upper %}{{ messages }}{% endfilter %}",
    "{{ messages | pprint }}",
    "{{ messages | dictsort }}",
    "{{ messages | groupby('role') }}",
    "{{ messages | map(attribute='content') | join(', ') }}",
    "{{ messages | selectattr('role', 'equalto', 'user') | list }}",
    "{{ messages | sort(attribute='content') }}",
    "{{ messages | unique }}",
    "{{ messages | first }}",
    "{{ messages | last | tojson }}",
    "{{ 'x' | urlencode }}",
    "{{ messages is divisibleby(0) }}",
    "{{ 10 is divisibleby(0) }}",
    "{{ cycler(1, 2).next() }}",
    "{{ joiner(',')() }}",
    "{{ namespace() }}",
    "{{ debug() }}",
    "{{ lipsum(1000000000) }}",
    "{% raw %}{{ x }}{% endraw %}",
    "{% autoescape true %}{{ '<' }}{% endautoescape %}",
    "{{ '\u{fdd0}' }}",
    "{{ '\u{fdd1}' }}",
    "{%- if true -%}",
    "{% endif %}",
    "{% endfor %}",
    "{{",
    "}}",
    "{%",
    "%}",
    "{#",
    "{{ undefined_variable.attr }}",
    "{{ message.content.strip().lstrip().rstrip().upper().lower().title() }}",
    "{{ message['content'] is string }}",
    "{{ (message.content | string)[0] }}",
];

/// A template source: a seed with one to four edits.
pub fn mutated_source(rng: &mut Rng) -> String {
    let mut s = rng.pick(templates()).clone();
    for _ in 0..rng.range(1, 4) {
        edit_source(&mut s, rng);
    }
    s
}

fn boundary(s: &str, rng: &mut Rng) -> usize {
    crate::json::floor_char_boundary(s, rng.position(s.len()))
}

fn edit_source(s: &mut String, rng: &mut Rng) {
    match rng.below(10) {
        0..=3 => {
            let at = boundary(s, rng);
            s.insert_str(at, rng.pick_str(SNIPPETS));
        }
        4 => {
            let (a, b) = (boundary(s, rng), boundary(s, rng));
            s.replace_range(a.min(b)..a.max(b), "");
        }
        5 => {
            let (a, b) = (boundary(s, rng), boundary(s, rng));
            let chunk = s[a.min(b)..a.max(b)].to_string();
            let at = boundary(s, rng);
            s.insert_str(at, &chunk);
        }
        6 => {
            // An integer literal made extreme.
            let digits: Vec<usize> = s
                .char_indices()
                .filter(|&(i, c)| {
                    c.is_ascii_digit() && (i == 0 || !s.as_bytes()[i - 1].is_ascii_digit())
                })
                .map(|(i, _)| i)
                .collect();
            if let Some(&at) = digits.get(rng.below(digits.len().max(1))) {
                let end = s[at..]
                    .find(|c: char| !c.is_ascii_digit())
                    .map_or(s.len(), |n| at + n);
                let n = crate::mutate::interesting_u64(rng).to_string();
                s.replace_range(at..end, &n);
            }
        }
        7 => {
            let at = boundary(s, rng);
            s.insert(at, crate::text::random_char(rng));
        }
        8 => {
            let at = boundary(s, rng);
            s.truncate(at);
        }
        _ => {
            // Blocks with the whitespace-control dash, or without it.
            *s = if rng.bool() {
                s.replace("{%", "{%-").replace("%}", "-%}")
            } else {
                s.replace("{%-", "{%").replace("-%}", "%}")
            };
        }
    }
}

/// Roles models are given, and roles they are not.
const ROLES: &[&str] = &[
    "user",
    "assistant",
    "system",
    "tool",
    "ipython",
    "",
    "USER",
    "model",
    "<|im_end|>",
    "{{ x }}",
    "user\n<|im_start|>system",
    "\u{fdd0}",
];

/// A case, built part by part.
pub fn generate(rng: &mut Rng) -> Vec<u8> {
    let tok = rng.below(tokenizers().len());
    let specials = &tokenizers()[tok].specials;
    let flags = (rng.below(2) | (tok << 1)) as u8;
    let mut parts: Vec<Vec<u8>> = vec![vec![flags]];
    let source = if rng.one_in(10) {
        rng.pick(templates()).clone()
    } else {
        mutated_source(rng)
    };
    parts.push(source.into_bytes());
    for _ in 0..2 {
        let t = match rng.below(4) {
            0 => String::new(),
            1 if !specials.is_empty() => rng.pick(specials).clone(),
            2 => rng
                .pick(&["<s>", "</s>", "<|im_end|>", "<|im_start|>"])
                .to_string(),
            _ => crate::text::generate(rng, specials, 2),
        };
        parts.push(t.into_bytes());
    }
    for _ in 0..rng.small(6) {
        let role = if rng.one_in(6) {
            crate::text::generate(rng, specials, 2)
        } else {
            rng.pick(ROLES).to_string()
        };
        let mut content = crate::text::generate(rng, specials, 8);
        if rng.one_in(8) {
            let at = boundary(&content, rng);
            content.insert_str(at, rng.pick_str(SNIPPETS));
        }
        parts.push(role.into_bytes());
        parts.push(content.into_bytes());
    }
    join(&parts)
}

fn join(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            out.push(SEP);
        }
        // Lossy UTF-8 never holds 0xFF, so no part does either.
        out.extend(p.iter().map(|&b| if b == SEP { 0xfe } else { b }));
    }
    out
}

/// Mutates an input of the target (libFuzzer's custom mutator): the source, a message, or bytes.
pub fn mutate(data: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut parts: Vec<Vec<u8>> = data.split(|&b| b == SEP).map(<[u8]>::to_vec).collect();
    if parts.len() < 2 {
        return generate(rng);
    }
    match rng.below(4) {
        0 | 1 => {
            let mut s = String::from_utf8_lossy(&parts[1]).into_owned();
            edit_source(&mut s, rng);
            parts[1] = s.into_bytes();
        }
        2 => {
            let specials = &tokenizers()[0].specials;
            parts.push(rng.pick(ROLES).as_bytes().to_vec());
            parts.push(crate::text::generate(rng, specials, 6).into_bytes());
        }
        _ => {
            let i = rng.below(parts.len());
            crate::mutate::bytes(&mut parts[i], rng, 3, &[]);
        }
    }
    join(&parts)
}

/// Unmutated seeds, for a libFuzzer corpus: each template with a short conversation.
pub fn seeds() -> Vec<Vec<u8>> {
    templates()
        .iter()
        .map(|t| {
            join(&[
                vec![1],
                t.as_bytes().to_vec(),
                b"<|im_start|>".to_vec(),
                b"<|im_end|>".to_vec(),
                b"system".to_vec(),
                b"Be brief.".to_vec(),
                b"user".to_vec(),
                b"hi <|im_end|> there".to_vec(),
            ])
        })
        .collect()
}

/// The target.
pub fn run(data: &[u8]) {
    let parts: Vec<String> = data
        .split(|&b| b == SEP)
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect();
    let flags = data.first().copied().unwrap_or(0);
    let add_generation_prompt = flags & 1 == 1;
    let seed_tokenizer = &tokenizers()[usize::from(flags >> 1) % tokenizers().len()];
    let part = |i: usize| parts.get(i).map_or("", String::as_str);
    let (source, bos, eos) = (part(1), part(2), part(3));
    let messages: Vec<ChatMessage> = parts
        .get(4..)
        .unwrap_or_default()
        .chunks(2)
        .take(16)
        .map(|m| ChatMessage::new(m[0].as_str(), m.get(1).map_or("", String::as_str)))
        .collect();

    let template = match ChatTemplate::new(source, bos, eos) {
        Ok(t) => t,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    let rendered = template.render(&messages, add_generation_prompt);
    if rendered.is_ok() {
        crate::accept();
    }
    let tokenizer = &seed_tokenizer.tokenizer;
    let encoded = template.encode(tokenizer, &messages, add_generation_prompt);
    let _ = rendered.as_ref().map_err(ToString::to_string);
    let _ = encoded.as_ref().map_err(ToString::to_string);

    // `encode` renders with marks around each message's content and takes them out again; what
    // it encodes must be the text `render` gives. (Inputs holding the marks themselves are
    // left out: `encode` strips them from the content first, by design.)
    let has_marks = |s: &str| s.contains(MARKS);
    let marked = [source, bos, eos].into_iter().any(has_marks)
        || messages
            .iter()
            .any(|m| has_marks(&m.role) || has_marks(&m.content));
    if let (Ok(text), Ok(ids), false) = (&rendered, &encoded, marked) {
        if seed_tokenizer.byte_level {
            let decoded = tokenizer
                .decode(ids)
                .unwrap_or_else(|e| panic!("encode gave ids that do not decode: {e}"));
            // Bytes without a token of their own are dropped (see `SeedTokenizer`).
            let kept: Vec<u8> = text
                .bytes()
                .filter(|&b| seed_tokenizer.byte_has_token[usize::from(b)])
                .collect();
            assert!(
                decoded == String::from_utf8_lossy(&kept),
                "ChatTemplate::encode encoded another text than render gives\n render: {text:?}\n encode: {decoded:?}"
            );
        }
    }
}
