//! Bookkeeping for a paged KV cache.
//!
//! This crate hands out block ids and tracks which sequence holds which blocks; it never touches KV
//! data, which lives in a backend's storage indexed by those ids. A token at position `p` of a
//! sequence lives in block `table[p / block_size]`, slot `p % block_size`.
//!
//! Two levels:
//! - [`BlockPool`] and [`BlockTable`]: exclusive blocks for one sequence at a time. Invariants,
//!   checked by [`BlockPool::check`]: every block is free xor in use, and `free + used == total`.
//! - [`KvManager`]: the persistent batch's cache of KV caches: many sequences, prefix sharing by
//!   content hash with reference counts, and LRU eviction of finished sequences
//!   (see [`manager`]).

mod block_cache;
pub mod manager;

pub use manager::{Admission, KvManager, SeqId, SeqState};
use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum KvError {
    #[error("the KV cache is full: {needed} more blocks needed, {free} free of {total}")]
    OutOfBlocks {
        needed: usize,
        free: usize,
        total: usize,
    },
    #[error("block {0} is not in use")]
    NotInUse(u32),
    #[error("sequence {0} is unknown")]
    UnknownSequence(SeqId),
    #[error("sequence {0} already exists")]
    SequenceExists(SeqId),
    #[error("sequence {seq} is {state:?}, not active")]
    NotActive { seq: SeqId, state: SeqState },
    #[error("sequence {seq}: {len} is past its {limit} {what}")]
    OutOfRange {
        seq: SeqId,
        len: usize,
        limit: usize,
        what: &'static str,
    },
    #[error(
        "sequence {seq}: cannot compact to {kept} keys (frozen prefix {frozen}, {keys} keys held, \
         evicting: {evicting})"
    )]
    BadCompaction {
        seq: SeqId,
        kept: usize,
        frozen: usize,
        keys: usize,
        evicting: bool,
    },
    #[error("sequence {seq}: commit up to {upto} is before its {computed} computed tokens")]
    CommitBackwards {
        seq: SeqId,
        computed: usize,
        upto: usize,
    },
}

/// A fixed pool of KV blocks. Fresh ids are handed out in increasing order before freed ones are
/// reused, so backends that grow their storage on demand only grow to the high-water mark.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    total: u32,
    next_fresh: u32,
    free: Vec<u32>,
    in_use: Vec<bool>,
}

impl BlockPool {
    pub fn new(total_blocks: u32, block_size: usize) -> Self {
        assert!(block_size > 0, "block size must be positive");
        BlockPool {
            block_size,
            total: total_blocks,
            next_fresh: 0,
            free: Vec::new(),
            in_use: vec![false; total_blocks as usize],
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn total(&self) -> usize {
        self.total as usize
    }

    pub fn num_free(&self) -> usize {
        self.free.len() + (self.total - self.next_fresh) as usize
    }

    pub fn num_used(&self) -> usize {
        self.total() - self.num_free()
    }

    /// Blocks ever handed out: the size a lazily grown backend storage must have.
    pub fn high_water_mark(&self) -> usize {
        self.next_fresh as usize
    }

    /// Takes `n` blocks, all or none.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<u32>, KvError> {
        if n > self.num_free() {
            return Err(KvError::OutOfBlocks {
                needed: n,
                free: self.num_free(),
                total: self.total(),
            });
        }
        let ids: Vec<u32> = (0..n)
            .map(|_| {
                self.free.pop().unwrap_or_else(|| {
                    self.next_fresh += 1;
                    self.next_fresh - 1
                })
            })
            .collect();
        for &id in &ids {
            self.in_use[id as usize] = true;
        }
        Ok(ids)
    }

    pub fn release(&mut self, id: u32) -> Result<(), KvError> {
        match self.in_use.get_mut(id as usize) {
            Some(used) if *used => {
                *used = false;
                self.free.push(id);
                Ok(())
            }
            _ => Err(KvError::NotInUse(id)),
        }
    }

    /// Verifies the pool's invariants; for tests and debug assertions.
    pub fn check(&self) -> Result<(), String> {
        let used = self.in_use.iter().filter(|u| **u).count();
        if used + self.num_free() != self.total() {
            return Err(format!(
                "used {used} + free {} != total {}",
                self.num_free(),
                self.total
            ));
        }
        if let Some(id) = self.free.iter().find(|&&id| self.in_use[id as usize]) {
            return Err(format!("block {id} is both free and in use"));
        }
        if self.in_use[self.next_fresh as usize..].iter().any(|u| *u) {
            return Err("a never-allocated block is marked in use".into());
        }
        Ok(())
    }
}

/// The blocks holding one sequence's KV, in token order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<u32>,
    len: usize,
}

impl BlockTable {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// Tokens whose KV is stored.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Grows the table to hold `new_len` tokens, taking blocks from `pool` as needed.
    pub fn reserve(&mut self, pool: &mut BlockPool, new_len: usize) -> Result<(), KvError> {
        let needed = new_len
            .div_ceil(pool.block_size())
            .saturating_sub(self.blocks.len());
        self.blocks.extend(pool.allocate(needed)?);
        Ok(())
    }

    /// Records that the first `len` tokens now hold KV; `len` must fit the reserved blocks.
    pub fn set_len(&mut self, len: usize, block_size: usize) {
        assert!(
            len <= self.blocks.len() * block_size,
            "length past the reserved blocks"
        );
        self.len = len;
    }

    /// Slot (`block * block_size + offset`) of each position in `positions`.
    pub fn slots(&self, positions: std::ops::Range<usize>, block_size: usize) -> Vec<u32> {
        positions
            .map(|p| self.blocks[p / block_size] * block_size as u32 + (p % block_size) as u32)
            .collect()
    }

    /// Drops the KV of tokens from `len` on, returning whole blocks no longer needed to the pool.
    pub fn truncate(&mut self, pool: &mut BlockPool, len: usize) -> Result<(), KvError> {
        let keep = len.div_ceil(pool.block_size());
        for id in self.blocks.drain(keep.min(self.blocks.len())..) {
            pool.release(id)?;
        }
        self.len = self.len.min(len);
        Ok(())
    }

    /// Returns every block to the pool.
    pub fn release(&mut self, pool: &mut BlockPool) -> Result<(), KvError> {
        self.truncate(pool, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Grow(usize, usize),
        Truncate(usize, usize),
        Release(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..4, 0usize..40).prop_map(|(s, n)| Op::Grow(s, n)),
            (0usize..4, 0usize..40).prop_map(|(s, n)| Op::Truncate(s, n)),
            (0usize..4).prop_map(Op::Release),
        ]
    }

    proptest! {
        #[test]
        fn invariants_hold_under_random_operations(ops in prop::collection::vec(op(), 1..200)) {
            let mut pool = BlockPool::new(16, 4);
            let mut tables = vec![BlockTable::new(); 4];
            for op in ops {
                match op {
                    Op::Grow(s, n) => {
                        let before = pool.num_free();
                        let t = &mut tables[s];
                        let target = t.len() + n;
                        match t.reserve(&mut pool, target) {
                            Ok(()) => t.set_len(target, 4),
                            Err(KvError::OutOfBlocks { .. }) => prop_assert_eq!(pool.num_free(), before),
                            Err(e) => prop_assert!(false, "{e}"),
                        }
                    }
                    Op::Truncate(s, n) => {
                        let len = tables[s].len().min(n);
                        tables[s].truncate(&mut pool, len).unwrap();
                    }
                    Op::Release(s) => tables[s].release(&mut pool).unwrap(),
                }
                pool.check().map_err(TestCaseError::fail)?;
                let held: usize = tables.iter().map(|t| t.blocks().len()).sum();
                prop_assert_eq!(held, pool.num_used());
                let mut all: Vec<u32> = tables.iter().flat_map(|t| t.blocks().to_vec()).collect();
                all.sort();
                all.dedup();
                prop_assert_eq!(all.len(), held, "a block is in two tables");
                for t in &tables {
                    prop_assert!(t.len() <= t.blocks().len() * 4);
                }
            }
        }
    }

    #[test]
    fn slots_follow_the_table() {
        let mut pool = BlockPool::new(8, 4);
        pool.allocate(2).unwrap(); // make the table's blocks non-trivial
        let mut t = BlockTable::new();
        t.reserve(&mut pool, 6).unwrap();
        assert_eq!(t.blocks(), &[2, 3]);
        assert_eq!(t.slots(3..6, 4), vec![11, 12, 13]);
        assert!(matches!(pool.release(7), Err(KvError::NotInUse(7))));
    }
}
