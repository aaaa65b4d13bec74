#![doc = include_str!("../README.md")]

pub mod cascade;
mod error;
pub mod kv_quant;
mod paged;
mod state;
mod tiled;

pub use error::AttentionError;
pub use kv_quant::{KvDtype, QuantKv};
pub use paged::{dot, paged_attention, try_paged_attention, KvRows, PagedKv, QuerySpan};
pub use state::{attend, merge_into, merge_states, AttentionState};
