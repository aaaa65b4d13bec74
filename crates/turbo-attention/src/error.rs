use thiserror::Error;

/// Why a batch cannot be attended: its buffers, spans, block tables or cascade groups do not fit
/// together. Checked before any work, so a malformed batch never indexes out of bounds.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum AttentionError {
    #[error("{0}")]
    Shape(String),
    #[error("span {span}: {reason}")]
    Span { span: usize, reason: String },
    #[error("cascade group {group}: {reason}")]
    Group { group: usize, reason: String },
}
