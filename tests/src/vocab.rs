//! A tiny byte-level BPE vocabulary, laid out like SmolLM2's: three control tokens, the 256
//! byte tokens, a few merges, then unused padding up to the model's vocabulary size.

use turbo_tokenizer::tokenizer::{GgufVocab, TextTokenizer};

/// llama.cpp token types.
pub const TOKEN_NORMAL: i32 = 1;
pub const TOKEN_CONTROL: i32 = 3;
pub const TOKEN_UNUSED: i32 = 5;

/// Control tokens, ids 0, 1, 2.
pub const CONTROL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
pub const BOS_ID: u32 = 1;
pub const EOS_ID: u32 = 2;

/// Merges in priority order; each merged token is in the vocabulary right after the byte tokens.
pub const MERGES: [&str; 10] = [
    "h e", "Ġ t", "i n", "e r", "Ġ a", "o n", "Ġt he", "l l", "r e", "Ġ s",
];

/// Tokens before padding.
pub const MIN_VOCAB: usize = CONTROL_TOKENS.len() + 256 + MERGES.len();

/// The pre-tokenizer name written to GGUF files (digits split one by one, then GPT-2's regex).
pub const PRE: &str = "smollm";

/// GPT-2's byte-to-printable-character mapping (`bytes_to_unicode`): entry `b` is the character
/// byte-level BPE vocabularies use for byte `b`.
pub fn byte_chars() -> [char; 256] {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut out = ['\0'; 256];
    let mut next = 256;
    for b in 0..256u32 {
        out[b as usize] = if printable(b) {
            char::from_u32(b).unwrap()
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap()
        };
    }
    out
}

/// The vocabulary as GGUF metadata holds it, padded to `vocab` tokens with unused ones.
pub fn tiny_vocab(vocab: usize) -> GgufVocab {
    assert!(
        vocab >= MIN_VOCAB,
        "the tiny vocabulary needs {MIN_VOCAB} tokens"
    );
    let mut tokens: Vec<String> = CONTROL_TOKENS.iter().map(|s| s.to_string()).collect();
    let mut types = vec![TOKEN_CONTROL; CONTROL_TOKENS.len()];
    for c in byte_chars() {
        tokens.push(c.to_string());
        types.push(TOKEN_NORMAL);
    }
    for m in MERGES {
        tokens.push(m.replace(' ', ""));
        types.push(TOKEN_NORMAL);
    }
    let mut n = 0;
    while tokens.len() < vocab {
        tokens.push(format!("<unused_{n}>"));
        types.push(TOKEN_UNUSED);
        n += 1;
    }
    GgufVocab {
        model: "gpt2".into(),
        pre: Some(PRE.into()),
        tokens,
        token_types: types,
        merges: MERGES.iter().map(|s| s.to_string()).collect(),
        bos_id: Some(BOS_ID),
        eos_id: Some(EOS_ID),
        add_bos: None,
        eot_id: None,
        eom_id: None,
    }
}

/// The tokenizer Turbo builds from [`tiny_vocab`].
pub fn tiny_tokenizer(vocab: usize) -> TextTokenizer {
    TextTokenizer::from_gguf_vocab(&tiny_vocab(vocab)).expect("the tiny vocabulary loads")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_chars_match_gpt2() {
        let c = byte_chars();
        assert_eq!(c[b'a' as usize], 'a');
        assert_eq!(c[b' ' as usize], 'Ġ');
        assert_eq!(c[b'\n' as usize], 'Ċ');
        assert_eq!(c[0], 'Ā');
        assert_eq!(c[0xAD], 'Ń');
        let mut all: Vec<char> = c.to_vec();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 256);
    }

    #[test]
    fn tokenizer_loads_and_merges() {
        let tok = tiny_tokenizer(300);
        assert_eq!(tok.vocab_size(), 300);
        assert_eq!(tok.eos_ids(), &[EOS_ID]);
        assert_eq!(tok.bos_id(), Some(BOS_ID));
        assert!(!tok.add_bos());
        let the = tok.token_id("Ġthe").unwrap();
        let ids = tok.encode("in the<|im_end|>").unwrap();
        assert_eq!(ids, vec![tok.token_id("in").unwrap(), the, EOS_ID]);
        for s in [
            "hello there, 123 héllo 🍕",
            "<|im_start|>user\nhi<|im_end|>\n",
        ] {
            assert_eq!(tok.decode(&tok.encode(s).unwrap()).unwrap(), s);
        }
        assert_eq!(tok.encode("12").unwrap().len(), 2);
    }
}
