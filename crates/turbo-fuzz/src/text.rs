//! Text that tokenizers and templates get wrong: scripts, emoji sequences, combining marks,
//! invisible and control characters, noncharacters, special tokens' texts and pieces of them,
//! long runs, and arbitrary code points.

use crate::rng::Rng;

/// Pieces of text from many scripts and corners of Unicode.
pub const FRAGMENTS: &[&str] = &[
    "Hello world",
    "hello",
    " the",
    "The quick brown fox jumps over the lazy dog.",
    "What is 2+2?",
    "12345",
    "3.14159",
    "1,000,000",
    "don't we'll I'M",
    "  ",
    "\n",
    "\n\n",
    "\r\n",
    "\t",
    " \t \n",
    "\u{a0}",
    "\u{3000}",
    "\u{200b}",
    "\u{200d}",
    "\u{2028}",
    "\u{feff}",
    "\u{0}",
    "\u{1b}[31m",
    "\u{7f}",
    "\u{85}",
    "é",
    "e\u{301}",
    "\u{1e9b}\u{323}",
    "Å",
    "ﬁ",
    "ß",
    "İ",
    "日本語のテキスト",
    "中文文本，还有",
    "한국어",
    "\u{1100}\u{1161}\u{11a8}",
    "العربية",
    "עִבְרִית",
    "\u{202e}abc\u{202c}",
    "हिन्दी",
    "ไทย",
    "Ελληνικά",
    "кириллица",
    "😀",
    "👍🏽",
    "👨\u{200d}👩\u{200d}👧\u{200d}👦",
    "🇫🇷🇯🇵",
    "🏳\u{fe0f}\u{200d}🌈",
    "🍕",
    "☕",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "\u{10ffff}",
    "\u{fffe}",
    "\u{fffd}",
    "\u{fdd0}",
    "\u{fdd1}",
    "\u{e000}",
    "Ġ",
    "Ċ",
    "<",
    "|",
    ">",
    "<|",
    "|>",
    "<s>",
    "</s>",
    "[INST]",
    "{{ messages }}",
    "{% if %}",
    "{#",
    "\\",
    "\"",
    "'",
];

/// A code point drawn from every plane, weighted towards the ones text holds.
pub fn random_char(rng: &mut Rng) -> char {
    let code = match rng.below(8) {
        0..=2 => rng.range(0x20, 0x7e) as u32,
        3 => rng.below(0x20) as u32,
        4 => rng.range(0x80, 0x7ff) as u32,
        5 => rng.range(0x800, 0xffff) as u32,
        6 => rng.range(0x1_0000, 0x10_ffff) as u32,
        _ => rng.range(0x1f300, 0x1faff) as u32,
    };
    char::from_u32(code).unwrap_or('\u{fffd}')
}

/// Text made of up to `max_pieces` pieces: fragments, the given special tokens' texts (whole, cut
/// or doubled), random characters, digit and whitespace runs, and long repeats.
pub fn generate(rng: &mut Rng, specials: &[String], max_pieces: usize) -> String {
    let mut out = String::new();
    for _ in 0..rng.small(max_pieces) {
        piece(rng, specials, &mut out);
    }
    out
}

fn piece(rng: &mut Rng, specials: &[String], out: &mut String) {
    match rng.below(14) {
        0..=3 => out.push_str(rng.pick_str(FRAGMENTS)),
        4 | 5 if !specials.is_empty() => {
            let s = rng.pick(specials);
            match rng.below(4) {
                0 => {
                    // A cut special token: the start or the end of its text.
                    let cut = crate::json::floor_char_boundary(s, rng.position(s.len()));
                    out.push_str(if rng.bool() { &s[..cut] } else { &s[cut..] });
                }
                1 => {
                    out.push_str(s);
                    out.push_str(s);
                }
                _ => out.push_str(s),
            }
        }
        6 => {
            for _ in 0..rng.small(24).max(1) {
                out.push(random_char(rng));
            }
        }
        7 => {
            for _ in 0..rng.small(40).max(1) {
                out.push(char::from(b'0' + rng.below(10) as u8));
            }
        }
        8 => {
            for _ in 0..rng.small(40).max(1) {
                out.push(*rng.pick(&[' ', '\n', '\t', '\r', '\u{a0}', '\u{3000}', '\u{b}']));
            }
        }
        9 => {
            // A long run: a fragment repeated, up to thousands of characters.
            let f = rng.pick(FRAGMENTS);
            out.push_str(&f.repeat(rng.small(2000).max(1)));
        }
        10 => {
            for _ in 0..rng.small(16).max(1) {
                out.push(char::from(rng.range(b'a' as usize, b'z' as usize) as u8));
            }
            out.push(' ');
        }
        11 => out.push_str(&String::from_utf8_lossy(&crate::mutate::invalid_utf8(rng))),
        _ => out.push(random_char(rng)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_text_mixes_specials_in() {
        let mut rng = Rng::new(5);
        let specials = vec!["<|im_end|>".to_string()];
        let texts: Vec<String> = (0..500).map(|_| generate(&mut rng, &specials, 8)).collect();
        assert!(texts.iter().any(|t| t.contains("<|im_end|>")));
        assert!(texts.iter().any(|t| t.is_empty()));
        assert!(texts.iter().any(|t| t.chars().count() > 100));
    }
}
