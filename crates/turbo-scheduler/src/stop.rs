//! Stop strings over streamed text: text that might be the start of a stop string is held back
//! until it is known not to be one, so a stop string never reaches the client.

/// Watches generated text for stop strings.
#[derive(Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    /// Text decoded but not yet released.
    pending: String,
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> Self {
        StopStrings {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
        }
    }

    /// Adds decoded text; returns the text now safe to release and whether a stop string was hit
    /// (in which case the returned text ends just before it).
    ///
    /// The work grows with the text held back, not with the stop strings' lengths: a stop string
    /// longer than that text is not searched for, and only prefixes that fit in it are tried.
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        let pending = self.pending.len();
        if let Some(at) = self
            .stops
            .iter()
            .filter(|s| s.len() <= pending)
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let hold = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len().min(pending + 1))
                    .rev()
                    .filter(|&n| s.is_char_boundary(n))
                    .find(|&n| self.pending.ends_with(&s[..n]))
            })
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// Releases held-back text at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_string_split_across_pushes_is_caught_and_never_released() {
        let mut s = StopStrings::new(vec!["\nUser:".into()]);
        assert_eq!(s.push("Hello"), ("Hello".into(), false));
        assert_eq!(s.push(" there\nUs"), (" there".into(), false));
        assert_eq!(s.push("er: hi"), ("".into(), true));
    }

    #[test]
    fn held_text_is_released_when_it_cannot_be_a_stop() {
        let mut s = StopStrings::new(vec!["END".into()]);
        assert_eq!(s.push("the E"), ("the ".into(), false));
        assert_eq!(s.push("ND"), ("".into(), true));
        let mut s = StopStrings::new(vec!["END".into()]);
        assert_eq!(s.push("the E"), ("the ".into(), false));
        assert_eq!(s.push("arth"), ("Earth".into(), false));
        assert_eq!(s.push(" E"), (" ".into(), false));
        assert_eq!(s.finish(), "E");
    }

    #[test]
    fn long_stop_strings_cost_only_the_text_held() {
        // A megabyte stop string that the text never completes: each push looks at the few
        // bytes held back, not at the megabyte (each push walked all of it before).
        let long = format!("ab{}", "x".repeat(1 << 20));
        let mut s = StopStrings::new(vec![long.clone(), "STOP".into()]);
        for _ in 0..2000 {
            assert_eq!(s.push("word "), ("word ".into(), false));
        }
        assert_eq!(s.push("a"), ("".into(), false));
        assert_eq!(s.push("b"), ("".into(), false));
        assert_eq!(s.push("xy"), ("abxy".into(), false));
        assert_eq!(s.push(" STOP"), (" ".into(), true));
        // And it still ends generation when the text does complete it.
        let mut s = StopStrings::new(vec![long.clone()]);
        assert_eq!(s.push("go "), ("go ".into(), false));
        assert_eq!(s.push(&long[..10]), ("".into(), false));
        assert_eq!(s.push(&long[10..]), ("".into(), true));
    }

    #[test]
    fn unicode_stop_strings_respect_char_boundaries() {
        let mut s = StopStrings::new(vec!["é!".into()]);
        assert_eq!(s.push("café"), ("caf".into(), false));
        assert_eq!(s.push("!"), ("".into(), true));
    }
}
