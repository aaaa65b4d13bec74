//! Turbo's foundation: element types, quantized block formats, weight storage, and the compute
//! backends (the [`Backend`] trait and its CPU implementation).

pub mod backend;
pub mod comm;
pub mod cpu;
pub mod dtype;
pub mod quant;
pub mod sampling;
pub mod storage;

pub use backend::{Backend, BackendError, KvCompaction, KvRuleCompaction, KvScoring};
pub use dtype::DType;
pub use storage::{Bytes, WeightMatrix};
pub use turbo_attention::KvDtype;
