#![doc = include_str!("../README.md")]

pub mod cascade;
mod error;
mod paged;
mod state;
mod tiled;

pub use error::AttentionError;
pub use paged::{dot, paged_attention, try_paged_attention, KvRows, PagedKv, QuerySpan};
pub use state::{attend, merge_into, merge_states, AttentionState};
