use std::fmt;
use std::path::PathBuf;
use turbo_core::DType;

/// Everything that can go wrong reading a GGUF file or looking things up in it.
///
/// Messages name the key, tensor or byte offset involved, since they usually end up in front of a
/// user holding a model file Turbo cannot load. Keys, names and strings come from the file, so
/// every message shows them [`Escaped`]: a corrupt or hostile file cannot send control
/// characters (terminal escape sequences, carriage returns) to whatever prints the error.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read '{}': {error}", Escaped(path.display()))]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("not a GGUF file: it starts with {found:02x?} instead of \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("GGUF version {0} is not supported (only versions 2 and 3 are)")]
    UnsupportedVersion(u32),
    #[error(
        "file is truncated: {} at offset {offset} runs past the end",
        Escaped(what)
    )]
    Truncated { what: String, offset: u64 },
    #[error("corrupt GGUF file: {}", Escaped(.0))]
    Corrupt(String),
    #[error("metadata key '{}' is missing", Escaped(.0))]
    MissingKey(String),
    #[error(
        "metadata key '{}' has type {}, expected {expected}",
        Escaped(key),
        Escaped(found)
    )]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("tensor '{}' is not in the file", Escaped(.0))]
    MissingTensor(String),
    #[error(
        "tensor '{}' has type {}, which Turbo does not support (supported: {})",
        Escaped(tensor),
        Escaped(type_name),
        supported_types()
    )]
    UnsupportedTensorType { tensor: String, type_name: String },
    #[error(
        "tensor '{}' has an unusable shape: {}",
        Escaped(tensor),
        Escaped(reason)
    )]
    BadShape { tensor: String, reason: String },
}

fn supported_types() -> String {
    DType::ALL.map(DType::name).join(", ")
}

impl GgufError {
    /// Says which part of the file a low-level read failure belongs to; the cursor that detects
    /// it only knows the offset.
    pub(crate) fn within(self, context: &str) -> Self {
        match self {
            GgufError::Truncated { what, offset } => GgufError::Truncated {
                what: format!("{what} of {context}"),
                offset,
            },
            GgufError::Corrupt(msg) => GgufError::Corrupt(format!("{context}: {msg}")),
            other => other,
        }
    }
}

/// Text that may come from a file, shown with control and other unprintable characters written
/// as Rust escapes (`\u{1b}`, `\n`), so that it cannot move a terminal's cursor, change its
/// colours or fake further lines of output. Quotes are left alone: messages put names in quotes
/// and stay readable; printable Unicode (accents, CJK, `▁`) is shown as is.
///
/// Messages hold raw text and escape it here, when shown, so that nothing is escaped twice.
pub struct Escaped<T>(pub T);

impl<T: fmt::Display> fmt::Display for Escaped<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        struct EscapeWriter<'a, 'b>(&'a mut fmt::Formatter<'b>);
        impl fmt::Write for EscapeWriter<'_, '_> {
            fn write_str(&mut self, s: &str) -> fmt::Result {
                for c in s.chars() {
                    match c {
                        '\'' | '"' => self.0.write_char(c)?,
                        c => write!(self.0, "{}", c.escape_debug())?,
                    }
                }
                Ok(())
            }
        }
        fmt::Write::write_fmt(&mut EscapeWriter(f), format_args!("{}", self.0))
    }
}
