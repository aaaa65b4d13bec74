//! How many cached keys a sequence keeps per (layer, KV head), and how they split into sinks,
//! recent tokens and key tokens.

use crate::Error;
use std::fmt;
use std::str::FromStr;

/// The size of the budget as given by the user.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BudgetSize {
    /// A fraction of the prompt length in (0, 1]; the paper's definition (`--kv-budget 0.5` keeps
    /// 50% of the prompt's tokens).
    Fraction(f64),
    /// An absolute number of tokens, at least 1.
    Tokens(usize),
}

impl BudgetSize {
    fn validate(self) -> Result<Self, Error> {
        match self {
            Self::Fraction(f) if !(f > 0.0 && f <= 1.0) => Err(Error::BudgetFraction(f)),
            Self::Tokens(0) => Err(Error::ZeroBudget),
            ok => Ok(ok),
        }
    }
}

/// Parses `0.5` or `50%` as a fraction of the prompt and a plain integer such as `512` as a token
/// count (so `1` is one token and `1.0` is the whole prompt). Out-of-range values are refused.
impl FromStr for BudgetSize {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let s = s.trim();
        let parse_err = || Error::ParseBudget(s.to_string());
        let size = if let Some(percent) = s.strip_suffix('%') {
            let p: f64 = percent.trim().parse().map_err(|_| parse_err())?;
            Self::Fraction(p / 100.0)
        } else if let Ok(tokens) = s.parse::<usize>() {
            Self::Tokens(tokens)
        } else {
            let f: f64 = s.parse().map_err(|_| parse_err())?;
            Self::Fraction(f)
        };
        size.validate()
    }
}

impl fmt::Display for BudgetSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Fraction(x) => write!(f, "{}%", x * 100.0),
            Self::Tokens(t) => write!(f, "{t} tokens"),
        }
    }
}

/// The user's budget settings, resolved per request into a [`Budget`] once the prompt length is
/// known.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetConfig {
    pub size: BudgetSize,
    /// Share of the kept tokens reserved for the most recent ones, in [0, 1]; the reference uses
    /// 0.3 (the paper finds 0.2–0.3 best).
    pub recent_fraction: f64,
    /// First tokens always kept (attention sinks). `None` takes the policy's default
    /// ([`crate::EvictionPolicy::default_sinks`]: 4 for StreamingLLM, 0 for the others).
    pub sinks: Option<usize>,
}

impl BudgetConfig {
    /// The reference's recent share.
    pub const DEFAULT_RECENT_FRACTION: f64 = 0.3;

    /// A budget of `size` with the default recent share and the policy's sinks.
    pub fn new(size: BudgetSize) -> Self {
        Self {
            size,
            recent_fraction: Self::DEFAULT_RECENT_FRACTION,
            sinks: None,
        }
    }

    /// Checks the ranges without resolving; for validating flags up front.
    pub fn validate(&self) -> Result<(), Error> {
        self.size.validate()?;
        let r = self.recent_fraction;
        if !(0.0..=1.0).contains(&r) {
            return Err(Error::RecentFraction(r));
        }
        Ok(())
    }

    /// The budget of a request whose prompt has `prompt_len` tokens, as the reference computes it:
    ///
    /// - `keep = max(floor(fraction * prompt_len), 1)`, or the token count;
    /// - `sinks = min(sinks or default_sinks, keep)`;
    /// - `recent = min(floor(recent_fraction * keep), keep - sinks)`;
    /// - the remaining `keep - sinks - recent` are key tokens.
    ///
    /// Clamping instead of refusing, because a short prompt must not fail a request.
    pub fn resolve(&self, prompt_len: usize, default_sinks: usize) -> Result<Budget, Error> {
        self.validate()?;
        let keep = match self.size {
            // In f64 the product is exact enough for any real prompt; `as` saturates.
            BudgetSize::Fraction(f) => ((f * prompt_len as f64).floor() as usize).max(1),
            BudgetSize::Tokens(t) => t,
        };
        let sinks = self.sinks.unwrap_or(default_sinks).min(keep);
        let recent = ((self.recent_fraction * keep as f64).floor() as usize).min(keep - sinks);
        Budget::new(keep, recent, sinks)
    }
}

impl Default for BudgetConfig {
    /// Half the prompt (the paper's headline setting), 30% of it recent.
    fn default() -> Self {
        Self::new(BudgetSize::Fraction(0.5))
    }
}

/// A resolved budget for one sequence: every (layer, KV head) keeps `min(keep, n)` of its `n`
/// cached keys. Invariant: `sinks + recent <= keep` and `keep >= 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Budget {
    keep: usize,
    recent: usize,
    sinks: usize,
}

impl Budget {
    /// `keep` tokens of which the `recent` most recent and the first `sinks` are always kept.
    pub fn new(keep: usize, recent: usize, sinks: usize) -> Result<Self, Error> {
        if keep == 0 {
            return Err(Error::ZeroBudget);
        }
        match recent.checked_add(sinks) {
            Some(reserved) if reserved <= keep => Ok(Self {
                keep,
                recent,
                sinks,
            }),
            _ => Err(Error::Overcommitted {
                keep,
                recent,
                sinks,
            }),
        }
    }

    /// The total number of keys kept (k).
    pub fn keep(&self) -> usize {
        self.keep
    }

    /// The most recent keys always kept (w).
    pub fn recent(&self) -> usize {
        self.recent
    }

    /// The first keys of the sequence always kept.
    pub fn sinks(&self) -> usize {
        self.sinks
    }

    /// The keys chosen by score: `keep - recent - sinks`.
    pub fn key_tokens(&self) -> usize {
        self.keep - self.recent - self.sinks
    }

    /// How many of `n` cached keys survive a selection: `min(keep, n)`, the same for every
    /// (layer, KV head).
    pub fn kept_count(&self, n: usize) -> usize {
        self.keep.min(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fractions_percentages_and_token_counts() {
        assert_eq!("0.5".parse(), Ok(BudgetSize::Fraction(0.5)));
        assert_eq!(" 50% ".parse(), Ok(BudgetSize::Fraction(0.5)));
        assert_eq!("1.0".parse(), Ok(BudgetSize::Fraction(1.0)));
        assert_eq!("100%".parse(), Ok(BudgetSize::Fraction(1.0)));
        assert_eq!("512".parse(), Ok(BudgetSize::Tokens(512)));
        assert_eq!("1".parse(), Ok(BudgetSize::Tokens(1)));
        assert_eq!("0".parse::<BudgetSize>(), Err(Error::ZeroBudget));
        assert_eq!("0.0".parse::<BudgetSize>(), Err(Error::BudgetFraction(0.0)));
        assert_eq!("1.5".parse::<BudgetSize>(), Err(Error::BudgetFraction(1.5)));
        assert_eq!(
            "150%".parse::<BudgetSize>(),
            Err(Error::BudgetFraction(1.5))
        );
        assert!(matches!(
            "-0.5".parse::<BudgetSize>(),
            Err(Error::BudgetFraction(_))
        ));
        assert!(matches!(
            "NaN".parse::<BudgetSize>(),
            Err(Error::BudgetFraction(_))
        ));
        assert!(matches!(
            "inf".parse::<BudgetSize>(),
            Err(Error::BudgetFraction(_))
        ));
        for bad in ["", "half", "0.5x", "%", "1e"] {
            assert_eq!(
                bad.parse::<BudgetSize>(),
                Err(Error::ParseBudget(bad.to_string()))
            );
        }
        let msg = "abc".parse::<BudgetSize>().unwrap_err().to_string();
        assert!(msg.contains("0.5") && msg.contains("512"), "{msg}");
    }

    #[test]
    fn resolves_like_the_reference() {
        let cfg = BudgetConfig::default();
        let b = cfg.resolve(100, 0).unwrap();
        assert_eq!(
            (b.keep(), b.recent(), b.sinks(), b.key_tokens()),
            (50, 15, 0, 35)
        );
        let b = cfg.resolve(101, 4).unwrap();
        assert_eq!(
            (b.keep(), b.recent(), b.sinks(), b.key_tokens()),
            (50, 15, 4, 31)
        );
        // Tiny prompts still keep one token; sinks and recent are clamped to fit.
        let b = cfg.resolve(1, 4).unwrap();
        assert_eq!((b.keep(), b.recent(), b.sinks()), (1, 0, 1));
        let b = cfg.resolve(0, 0).unwrap();
        assert_eq!(b.keep(), 1);
        let cfg = BudgetConfig {
            size: BudgetSize::Tokens(10),
            recent_fraction: 1.0,
            sinks: Some(3),
        };
        let b = cfg.resolve(5, 0).unwrap();
        assert_eq!(
            (b.keep(), b.recent(), b.sinks(), b.key_tokens()),
            (10, 7, 3, 0)
        );
    }

    #[test]
    fn refuses_bad_settings() {
        let mut cfg = BudgetConfig {
            recent_fraction: 1.5,
            ..BudgetConfig::default()
        };
        assert_eq!(cfg.resolve(10, 0), Err(Error::RecentFraction(1.5)));
        cfg.recent_fraction = -0.1;
        assert_eq!(cfg.validate(), Err(Error::RecentFraction(-0.1)));
        cfg.recent_fraction = f64::NAN;
        assert!(cfg.validate().is_err());
        let cfg = BudgetConfig::new(BudgetSize::Fraction(0.0));
        assert_eq!(cfg.resolve(10, 0), Err(Error::BudgetFraction(0.0)));
        let cfg = BudgetConfig::new(BudgetSize::Tokens(0));
        assert_eq!(cfg.resolve(10, 0), Err(Error::ZeroBudget));
        assert_eq!(Budget::new(0, 0, 0), Err(Error::ZeroBudget));
        assert!(matches!(
            Budget::new(4, 3, 2),
            Err(Error::Overcommitted { .. })
        ));
        assert!(Budget::new(4, usize::MAX, 2).is_err());
        assert!(Budget::new(4, 2, 2).is_ok());
    }

    #[test]
    fn kept_count_is_min_of_keep_and_n() {
        let b = Budget::new(8, 2, 0).unwrap();
        assert_eq!(b.kept_count(0), 0);
        assert_eq!(b.kept_count(5), 5);
        assert_eq!(b.kept_count(8), 8);
        assert_eq!(b.kept_count(100), 8);
    }
}
