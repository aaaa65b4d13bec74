//! The tokenizer target: arbitrary text through [`TextTokenizer`]'s `encode`,
//! `encode_untrusted`, `encode_with_bos`, `decode`, `token_bytes` and the streaming
//! detokenizer, on the tiny GGUF-built tokenizer, the same loaded back from `tokenizer.json`,
//! and SmolLM2's real one where present.
//!
//! Invariants, beyond not panicking: these tokenizers are byte-level BPE without a normalizer,
//! so the tokens' bytes concatenate to the text's bytes, less the bytes the vocabulary has no
//! token for (SmolLM2's lacks 21, see [`SeedTokenizer::byte_has_token`]), and `decode` is those
//! bytes as (lossy) UTF-8: `decode(encode(text)) == text` for any text without such bytes.
//! `encode_untrusted` with no untrusted range is `encode`; with ranges, no special token id
//! comes from text that overlaps one, and the text round-trips the same way; streaming the ids
//! piece by piece gives `decode` of them all; `decode` refuses ids outside the vocabulary.
//!
//! An input is its parts separated by `0xFF`: a selector byte (which tokenizer), the text
//! (lossy UTF-8), untrusted ranges (pairs of little-endian u16, the top values standing for
//! `usize::MAX` and its neighbours), and token ids to decode (little-endian u32).

use crate::rng::Rng;
use crate::seeds::{texts, tokenizers, SeedTokenizer};
use std::ops::Range;
use turbo_tokenizer::TextStream;

const SEP: u8 = 0xff;

/// Most ids streamed through `TextStream` per case.
const STREAM_MAX_IDS: usize = 1024;

fn decode_index(v: u16) -> usize {
    match v {
        0xfff0.. => usize::MAX - usize::from(0xffff - v),
        v => usize::from(v),
    }
}

fn encode_index(v: usize) -> u16 {
    match v {
        v if v >= usize::MAX - 15 => 0xffff - (usize::MAX - v) as u16,
        v => v.min(0xffef) as u16,
    }
}

/// The target.
pub fn run(data: &[u8]) {
    let mut parts = data.split(|&b| b == SEP);
    let selector = parts.next().and_then(|p| p.first()).copied().unwrap_or(0);
    let seed = &tokenizers()[usize::from(selector) % tokenizers().len()];
    let text = String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
    let ranges: Vec<Range<usize>> = parts
        .next()
        .unwrap_or_default()
        .chunks_exact(4)
        .map(|c| {
            decode_index(u16::from_le_bytes([c[0], c[1]]))
                ..decode_index(u16::from_le_bytes([c[2], c[3]]))
        })
        .collect();
    let ids: Vec<u32> = parts
        .next()
        .unwrap_or_default()
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    check_text(seed, &text, &ranges);
    check_ids(seed, &ids);
    crate::accept();
}

fn check_text(seed: &SeedTokenizer, text: &str, ranges: &[Range<usize>]) {
    let tok = &seed.tokenizer;
    let vocab = seed.vocab;
    let ids = tok
        .encode(text)
        .unwrap_or_else(|e| panic!("encode failed on text: {e}"));
    assert!(
        ids.iter().all(|&id| (id as usize) < vocab),
        "encode made an id outside the vocabulary: {ids:?}"
    );
    let kept: Vec<u8> = text
        .bytes()
        .filter(|&b| seed.byte_has_token[usize::from(b)])
        .collect();
    if seed.byte_level {
        check_round_trip(seed, "encode", text, &kept, &ids);
        // Streaming is quadratic while the text ends in U+FFFD (docs/reliability.md, N2): a
        // prefix keeps the case's time bounded.
        let head = &ids[..ids.len().min(STREAM_MAX_IDS)];
        let streamed = stream(seed, head);
        let back = tok.decode(head).expect("checked");
        assert!(streamed == back, "streamed text != decode: {streamed:?}");
    }
    let with_bos = tok
        .encode_with_bos(text)
        .unwrap_or_else(|e| panic!("encode_with_bos failed: {e}"));
    assert!(with_bos.len() == ids.len() || with_bos.len() == ids.len() + 1);

    let plain = tok
        .encode_untrusted(text, &[])
        .unwrap_or_else(|e| panic!("encode_untrusted failed: {e}"));
    assert!(
        plain == ids,
        "encode_untrusted(text, []) != encode(text): {plain:?} vs {ids:?}"
    );
    let untrusted = tok
        .encode_untrusted(text, ranges)
        .unwrap_or_else(|e| panic!("encode_untrusted failed: {e}"));
    if seed.byte_level {
        check_round_trip(seed, "encode_untrusted", text, &kept, &untrusted);
        // No special token from text that overlaps an untrusted range (the same overlap test
        // `encode_untrusted` documents: any byte in common). Tokens stand for the kept bytes in
        // order; `kept_at` maps them back to their places in the text.
        let kept_at: Vec<usize> = (0..text.len())
            .filter(|&i| seed.byte_has_token[usize::from(text.as_bytes()[i])])
            .collect();
        let mut at = 0;
        for &id in &untrusted {
            let len = tok.token_bytes(id).expect("an id encode made").len();
            if seed.special_ids.contains(&id) && len > 0 {
                let (start, end) = (kept_at[at], kept_at[at + len - 1] + 1);
                if let Some(r) = ranges.iter().find(|r| start < r.end && r.start < end) {
                    panic!(
                        "special token {id} made from bytes {start}..{end}, inside untrusted \
                         range {r:?}"
                    );
                }
            }
            at += len;
        }
    }
}

/// The ids' bytes are the text's that have tokens (`kept`), and decode to them; when no byte
/// was dropped, to the text.
fn check_round_trip(seed: &SeedTokenizer, how: &str, text: &str, kept: &[u8], ids: &[u32]) {
    let back = seed
        .tokenizer
        .decode(ids)
        .unwrap_or_else(|e| panic!("decode of {how} ids failed: {e}"));
    let bytes = concat_bytes(seed, ids);
    assert!(
        bytes == kept && back == String::from_utf8_lossy(kept),
        "{}: {how} does not round-trip\n text: {text:?}\n back: {back:?}\n ids: {ids:?}",
        seed.name
    );
}

fn concat_bytes(seed: &SeedTokenizer, ids: &[u32]) -> Vec<u8> {
    ids.iter()
        .flat_map(|&id| {
            seed.tokenizer
                .token_bytes(id)
                .unwrap_or_else(|e| panic!("token_bytes({id}): {e}"))
        })
        .collect()
}

fn stream(seed: &SeedTokenizer, ids: &[u32]) -> String {
    let mut s = TextStream::new();
    let mut out = String::new();
    for &id in ids {
        out.push_str(
            &s.push(&seed.tokenizer, id)
                .unwrap_or_else(|e| panic!("TextStream::push({id}): {e}")),
        );
    }
    out.push_str(
        &s.finish(&seed.tokenizer)
            .unwrap_or_else(|e| panic!("TextStream::finish: {e}")),
    );
    out
}

/// Arbitrary ids: `decode` fails exactly when one is outside the vocabulary, streams agree with
/// it, and `token_bytes` / `token_text` / `id_to_token` answer for any id.
fn check_ids(seed: &SeedTokenizer, ids: &[u32]) {
    let tok = &seed.tokenizer;
    let vocab = seed.vocab;
    for &id in ids {
        let known = (id as usize) < vocab;
        assert_eq!(tok.token_bytes(id).is_ok(), known, "token_bytes({id})");
        assert_eq!(tok.token_text(id).is_ok(), known, "token_text({id})");
        let _ = (tok.id_to_token(id), tok.is_eos(id));
    }
    let in_range = ids.iter().all(|&id| (id as usize) < vocab);
    match tok.decode(ids) {
        Ok(text) => {
            assert!(in_range, "decode accepted an id outside the vocabulary");
            let streamed = stream(seed, ids);
            assert!(
                streamed == text,
                "streamed text != decode for ids {ids:?}: {streamed:?} vs {text:?}"
            );
        }
        Err(e) => {
            assert!(!in_range, "decode failed on ids in the vocabulary: {e}");
        }
    }
}

/// A case: text from fragments, special tokens and seeds; ranges around special tokens' texts
/// or anywhere; ids mostly inside the vocabulary.
pub fn generate(rng: &mut Rng) -> Vec<u8> {
    let which = rng.below(tokenizers().len());
    let seed = &tokenizers()[which];
    let mut text = match rng.below(4) {
        0 => rng.pick(texts()).clone(),
        _ => crate::text::generate(rng, &seed.specials, 10),
    };
    if rng.one_in(4) {
        let extra = crate::text::generate(rng, &seed.specials, 4);
        let at = crate::json::floor_char_boundary(&text, rng.position(text.len()));
        text.insert_str(at, &extra);
    }
    let mut ranges = Vec::new();
    for _ in 0..rng.small(4) {
        let len = text.len();
        let (a, b) = match rng.below(6) {
            // Around a special token's text.
            0 | 1 => match seed
                .specials
                .iter()
                .filter_map(|s| text.find(s.as_str()).map(|at| (at, at + s.len())))
                .next()
            {
                Some((s, e)) => (
                    s.saturating_sub(rng.below(3)),
                    e + rng.below(3) - usize::from(rng.bool()),
                ),
                None => (0, len),
            },
            2 => (0, len),
            3 => (rng.position(len), rng.position(len)),
            4 => (rng.position(len), usize::MAX - rng.below(3)),
            _ => (rng.position(len + 8), rng.position(len + 8)),
        };
        ranges.push((a, b));
    }
    let mut ids = Vec::new();
    let vocab = seed.vocab;
    for _ in 0..rng.small(24) {
        // Ids outside the vocabulary are rare: each costs `decode` and `token_bytes` a copy of
        // the vocabulary (`vocab_size`) to say so.
        ids.push(match rng.below(40) {
            0 => vocab as u32 + rng.below(3) as u32,
            1 => u32::MAX,
            2 => *rng.pick(&[0, 1, 2]),
            _ => rng.below(vocab) as u32,
        });
    }
    let mut out = vec![which as u8, SEP];
    out.extend(text.bytes());
    out.push(SEP);
    for (a, b) in ranges {
        out.extend(encode_index(a).to_le_bytes());
        out.extend(encode_index(b).to_le_bytes());
    }
    out.push(SEP);
    for id in ids {
        out.extend(id.to_le_bytes());
    }
    out
}

/// Mutates an input of the target (libFuzzer's custom mutator): the text with fragments spliced
/// in, or the bytes.
pub fn mutate(data: &[u8], rng: &mut Rng) -> Vec<u8> {
    if rng.bool() {
        let mut out = data.to_vec();
        crate::mutate::bytes(&mut out, rng, 4, &[]);
        return out;
    }
    let mut parts: Vec<Vec<u8>> = data.split(|&b| b == SEP).map(<[u8]>::to_vec).collect();
    if parts.len() < 2 {
        return generate(rng);
    }
    let specials = &tokenizers()[0].specials;
    let mut text = String::from_utf8_lossy(&parts[1]).into_owned();
    let at = crate::json::floor_char_boundary(&text, rng.position(text.len()));
    text.insert_str(at, &crate::text::generate(rng, specials, 3));
    parts[1] = text.into_bytes();
    parts.join(&SEP)
}

/// Unmutated seeds, for a libFuzzer corpus: the seed texts on each tokenizer.
pub fn seeds() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for which in 0..tokenizers().len() {
        for t in texts().iter().take(24) {
            let mut s = vec![which as u8, SEP];
            s.extend(t.bytes());
            s.extend([SEP, 0, 0, 4, 0, SEP, 1, 0, 0, 0]);
            out.push(s);
        }
    }
    out
}
