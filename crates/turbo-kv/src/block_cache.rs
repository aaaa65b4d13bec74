//! Reference-counted blocks with content addressing: the block half of [`crate::KvManager`].
//!
//! A block is in exactly one of three states:
//! - **free**: holds nothing useful; on the free list.
//! - **used**: referenced by `refs > 0` block tables.
//! - **evictable**: `refs == 0`, but it still holds the KV of a full, hashed block, so a later
//!   sequence with the same prefix can take it back by hash. It is reallocated (and forgotten)
//!   only when no free block is left, least recently released first.
//!
//! A full block's hash chains the previous block's hash with its own token ids, so equal hashes
//! mean equal prefixes, not just equal blocks. Hashes use per-cache random keys (so clients cannot
//! craft collisions) and every lookup also compares the stored token ids and parent hash, so a
//! collision can never hand out the wrong KV.

use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hasher};

/// Hash of a full block and, through its parent's hash, of every token before it.
pub(crate) type BlockHash = u64;

/// What a full, committed block holds, kept to verify hash lookups.
#[derive(Debug, Clone)]
struct Content {
    hash: BlockHash,
    parent: Option<BlockHash>,
    tokens: Box<[u32]>,
}

#[derive(Debug, Clone, Default)]
struct Block {
    refs: u32,
    /// `Some` once the block is full and its KV committed; such a block is read-only.
    content: Option<Content>,
    /// The block's key in `evictable`, while it is there.
    released_at: Option<u64>,
}

#[derive(Debug, Clone)]
pub(crate) struct BlockCache {
    blocks: Vec<Block>,
    /// Free blocks, popped from the end; starts as `0..n` reversed so fresh ids come in order.
    free: Vec<u32>,
    /// Evictable blocks by release time: the first entry is reallocated first.
    evictable: BTreeMap<u64, u32>,
    /// One block per known content hash (duplicates may exist; lookups need to find one).
    by_hash: HashMap<BlockHash, u32>,
    clock: u64,
    hasher: RandomState,
}

impl BlockCache {
    pub(crate) fn new(num_blocks: u32) -> Self {
        BlockCache {
            blocks: vec![Block::default(); num_blocks as usize],
            free: (0..num_blocks).rev().collect(),
            evictable: BTreeMap::new(),
            by_hash: HashMap::new(),
            clock: 0,
            hasher: RandomState::new(),
        }
    }

    pub(crate) fn total(&self) -> usize {
        self.blocks.len()
    }

    pub(crate) fn num_free(&self) -> usize {
        self.free.len()
    }

    pub(crate) fn num_evictable(&self) -> usize {
        self.evictable.len()
    }

    pub(crate) fn refs(&self, id: u32) -> u32 {
        self.blocks.get(id as usize).map_or(0, |b| b.refs)
    }

    pub(crate) fn hash(&self, id: u32) -> Option<BlockHash> {
        self.blocks[id as usize].content.as_ref().map(|c| c.hash)
    }

    /// The chained hash of a full block of `tokens` following a block hashed `parent`.
    pub(crate) fn chain_hash(&self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let mut h = self.hasher.build_hasher();
        match parent {
            None => h.write_u8(0),
            Some(p) => {
                h.write_u8(1);
                h.write_u64(p);
            }
        }
        for &t in tokens {
            h.write_u32(t);
        }
        h.finish()
    }

    /// A block holding exactly `tokens` after a block hashed `parent`, if one is still resident.
    pub(crate) fn lookup(
        &self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
    ) -> Option<u32> {
        let id = *self.by_hash.get(&hash)?;
        let c = self.blocks[id as usize].content.as_ref()?;
        (c.parent == parent && *c.tokens == *tokens).then_some(id)
    }

    /// Takes a block that holds nothing: a free one, else the least recently released evictable
    /// one (whose content is forgotten). `None` when neither is left.
    pub(crate) fn take(&mut self) -> Option<u32> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let (_, id) = self.evictable.pop_first()?;
                self.blocks[id as usize].released_at = None;
                self.forget(id);
                id
            }
        };
        self.blocks[id as usize].refs = 1;
        Some(id)
    }

    /// Adds a reference to a used or evictable block (prefix sharing).
    pub(crate) fn retain(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        if let Some(at) = b.released_at.take() {
            self.evictable.remove(&at);
        }
        debug_assert!(b.refs > 0 || b.content.is_some(), "retained a free block");
        b.refs += 1;
    }

    /// Drops a reference. A block nobody holds becomes evictable if its content can still be found
    /// by hash, free otherwise.
    pub(crate) fn release(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        assert!(b.refs > 0, "released block {id} with no references");
        b.refs -= 1;
        if b.refs > 0 {
            return;
        }
        let findable = match &b.content {
            None => false,
            // A duplicate of content that another block already serves is of no further use;
            // content whose registered block was reallocated is registered again here.
            Some(c) => *self.by_hash.entry(c.hash).or_insert(id) == id,
        };
        if findable {
            self.clock += 1;
            self.blocks[id as usize].released_at = Some(self.clock);
            self.evictable.insert(self.clock, id);
        } else {
            self.blocks[id as usize].content = None;
            self.free.push(id);
        }
    }

    /// Records that a used block is full with `tokens` (its KV written), making it findable by
    /// `hash` unless an equal block already is.
    pub(crate) fn register(
        &mut self,
        id: u32,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
    ) {
        debug_assert!(self.blocks[id as usize].content.is_none());
        self.by_hash.entry(hash).or_insert(id);
        self.blocks[id as usize].content = Some(Content {
            hash,
            parent,
            tokens: tokens.into(),
        });
    }

    /// Makes a block that only its one holder references writable again: it stops being findable.
    pub(crate) fn unregister(&mut self, id: u32) {
        debug_assert_eq!(self.blocks[id as usize].refs, 1);
        self.forget(id);
    }

    fn forget(&mut self, id: u32) {
        if let Some(c) = self.blocks[id as usize].content.take() {
            if self.by_hash.get(&c.hash) == Some(&id) {
                self.by_hash.remove(&c.hash);
            }
        }
    }

    /// Verifies the block states; `table_refs[b]` is how many block tables hold block `b`.
    pub(crate) fn check(&self, table_refs: &[u32]) -> Result<(), String> {
        let mut on_free = vec![false; self.blocks.len()];
        for &id in &self.free {
            let slot = on_free
                .get_mut(id as usize)
                .ok_or(format!("free block {id} out of range"))?;
            if std::mem::replace(slot, true) {
                return Err(format!("block {id} is on the free list twice"));
            }
        }
        for (&at, &id) in &self.evictable {
            if self.blocks.get(id as usize).and_then(|b| b.released_at) != Some(at) {
                return Err(format!(
                    "evictable entry {at} -> {id} disagrees with the block"
                ));
            }
        }
        let mut used = 0;
        for (id, b) in self.blocks.iter().enumerate() {
            let id32 = id as u32;
            if b.refs != table_refs[id] {
                return Err(format!(
                    "block {id} has {} references but is in {} tables",
                    b.refs, table_refs[id]
                ));
            }
            let evictable = b.released_at.is_some();
            match (b.refs > 0, on_free[id], evictable) {
                (true, false, false) => used += 1,
                (false, true, false) if b.content.is_none() => {}
                (false, false, true) => {
                    let hash = b.content.as_ref().map(|c| c.hash);
                    if hash.and_then(|h| self.by_hash.get(&h)) != Some(&id32) {
                        return Err(format!("evictable block {id} cannot be found by hash"));
                    }
                }
                state => {
                    return Err(format!(
                        "block {id} is not exactly one of used/free/evictable: {state:?}"
                    ))
                }
            }
        }
        if used + self.free.len() + self.evictable.len() != self.blocks.len() {
            return Err("used + free + evictable != total".into());
        }
        for (&h, &id) in &self.by_hash {
            let b = &self.blocks[id as usize];
            if b.content.as_ref().map(|c| c.hash) != Some(h) {
                return Err(format!(
                    "hash entry {h:x} points at block {id} holding other content"
                ));
            }
            let c = b.content.as_ref().expect("checked above");
            if self.chain_hash(c.parent, &c.tokens) != h {
                return Err(format!("block {id}'s hash does not match its tokens"));
            }
        }
        Ok(())
    }
}
