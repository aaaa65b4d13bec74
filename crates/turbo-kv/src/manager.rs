//! The KV cache manager of the persistent batch: a "cache of KV caches" (TurboMind) with prefix
//! sharing between sequences (vLLM, nano-vllm).
//!
//! Sequences outlive requests. A finished sequence stays resident ("idle") with its blocks, so its
//! next turn prefills only what is new (a cache hit). When blocks run out, the least recently used
//! idle sequence is evicted: it keeps only its token ids and, when it comes back, re-attaches the
//! prefix blocks that are still resident and recomputes the rest (a miss).
//!
//! Full blocks are content-addressed (see [`crate::block_cache`]), so sequences that start with
//! the same tokens (a system prompt, a forked sequence) hold the same blocks, reference-counted.
//! A shared block is read-only: a sequence only writes into its last, partial block, which is never
//! shared. Only block ids live here; the KV data is the backend's, indexed by those ids.
//!
//! A sequence's life: [`KvManager::admit`] (with its whole token list) → [`KvManager::reserve`] →
//! the model writes the KV of the uncomputed tokens → [`KvManager::commit`] →
//! [`KvManager::append_token`] per generated token, reserving and committing as it goes →
//! [`KvManager::finish`] (idle, resident) or [`KvManager::free`] (gone).
//!
//! KV eviction: a sequence admitted with [`KvManager::admit_evicting`] may hold fewer keys than
//! it has computed tokens. [`KvManager::compact`] records that the backend moved its kept keys to
//! its leading key indices and gives its tail blocks back. Such a sequence never rewrites shared
//! blocks: the full blocks it found by hash at admission stay as they are (its *frozen* prefix,
//! which every selection keeps), and it publishes none of its own, since compaction would change
//! their content under their hash. Its next token's position stays its true position
//! (`computed`); only its key count (`computed - evicted`) shrinks. Preempted or evicted, it
//! keeps its token ids and is recomputed (and compacted again) from them.
//!
//! [`KvManager::without_reuse`] turns all reuse off (no sharing, nothing resident after a
//! request): the baseline that benchmarks of the cache compare against.

use crate::block_cache::BlockCache;
use crate::KvError;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

/// Identifies a sequence (a conversation) across requests.
pub type SeqId = u64;

/// Where a sequence's KV is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqState {
    /// Being run: holds its blocks, may reserve, commit and append.
    Active,
    /// Its request finished; it keeps its blocks until evicted (least recently used first).
    Idle,
    /// Evicted, preempted, or finished without reuse: only its token ids remain, and
    /// `computed == 0`.
    Evicted,
}

/// What [`KvManager::admit`] found already computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// Leading tokens whose KV is in the sequence's blocks and need not be run again; always
    /// below the token count, so the last token is run and its logits exist.
    pub cached: usize,
}

#[derive(Debug, Clone)]
struct Sequence {
    tokens: Vec<u32>,
    /// Blocks in token order. Blocks `0..computed / block_size` are full, hashed and may be
    /// shared; any later block is this sequence's alone.
    blocks: Vec<u32>,
    /// Leading tokens whose KV is written in `blocks`.
    computed: usize,
    state: SeqState,
    /// The sequence's key in [`KvManager::idle`] while idle.
    idle_since: Option<u64>,
    /// Whether its KV may be compacted (see the module docs); it then publishes no blocks.
    evicting: bool,
    /// Leading keys in the shared, hashed blocks it found at admission: never rewritten (0
    /// unless evicting).
    frozen: usize,
    /// The bound on `frozen` it was admitted with (its budget's room for a shared prefix).
    max_frozen: usize,
    /// Computed tokens whose KV was dropped by compaction: the sequence holds
    /// `computed - evicted` keys, and token `p >= computed` goes to key index `p - evicted`.
    evicted: usize,
}

impl Sequence {
    fn empty() -> Self {
        Sequence {
            tokens: Vec::new(),
            blocks: Vec::new(),
            computed: 0,
            state: SeqState::Evicted,
            idle_since: None,
            evicting: false,
            frozen: 0,
            max_frozen: 0,
            evicted: 0,
        }
    }

    /// Keys held: computed tokens not evicted.
    fn keys(&self) -> usize {
        self.computed - self.evicted
    }

    /// Drops everything but the frozen prefix (the only part of an evicting sequence's KV whose
    /// content is what its tokens say), and turns eviction off until the next admission.
    fn forget_evictions(&mut self, cache: &mut BlockCache, block_size: usize) {
        let keep = (self.frozen / block_size).min(self.blocks.len());
        while self.blocks.len() > keep {
            cache.release(self.blocks.pop().expect("len > keep"));
        }
        self.computed = keep * block_size;
        self.tokens.truncate(self.computed);
        self.evicting = false;
        self.frozen = 0;
        self.evicted = 0;
    }
}

/// Hands out KV blocks to the sequences of a persistent batch, sharing equal prefixes and keeping
/// finished sequences resident until their blocks are needed.
///
/// Invariants (checked by [`KvManager::check`]): every block is free xor used (referenced) xor
/// evictable (unreferenced but findable by hash); a block's reference count equals the number of
/// tables holding it; a table covers its sequence's computed tokens; shared blocks are full and
/// hashed by the tokens they hold. Without reuse: no block is hashed or shared, and no sequence is
/// idle.
#[derive(Debug, Clone)]
pub struct KvManager {
    block_size: usize,
    cache: BlockCache,
    seqs: HashMap<SeqId, Sequence>,
    /// Idle sequences by the time they finished: the first one is evicted first.
    idle: BTreeMap<u64, SeqId>,
    clock: u64,
    /// Whether computed KV is reused: blocks shared by content, sequences kept resident.
    reuse: bool,
}

impl KvManager {
    /// A manager of `num_blocks` blocks of `block_size` tokens each.
    pub fn new(num_blocks: u32, block_size: usize) -> Self {
        assert!(block_size > 0, "block size must be positive");
        KvManager {
            block_size,
            cache: BlockCache::new(num_blocks),
            seqs: HashMap::new(),
            idle: BTreeMap::new(),
            clock: 0,
            reuse: true,
        }
    }

    /// A manager that never reuses computed KV: every admission starts from nothing
    /// (`cached == 0`), no block is shared, and a finished sequence gives its blocks back at once
    /// (it is left evicted). What prefix sharing and sessions save is measured against this.
    pub fn without_reuse(num_blocks: u32, block_size: usize) -> Self {
        KvManager {
            reuse: false,
            ..Self::new(num_blocks, block_size)
        }
    }

    /// Whether computed KV is reused (see [`KvManager::without_reuse`]).
    pub fn reuses_kv(&self) -> bool {
        self.reuse
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn total(&self) -> usize {
        self.cache.total()
    }

    /// Blocks that hold nothing.
    pub fn num_free(&self) -> usize {
        self.cache.num_free()
    }

    /// Blocks no sequence holds that still hold a findable full block, kept for prefix reuse and
    /// reallocated once no free block is left.
    pub fn num_evictable(&self) -> usize {
        self.cache.num_evictable()
    }

    /// Blocks held by at least one sequence (active or idle).
    pub fn num_used(&self) -> usize {
        self.total() - self.num_free() - self.num_evictable()
    }

    /// Idle sequences: finished, resident, evictable under pressure.
    pub fn num_cached_idle(&self) -> usize {
        self.idle.len()
    }

    /// Sequences known in any state.
    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Tables holding `block` (0 for a free or evictable block).
    pub fn ref_count(&self, block: u32) -> u32 {
        self.cache.refs(block)
    }

    pub fn state(&self, seq: SeqId) -> Option<SeqState> {
        self.seqs.get(&seq).map(|s| s.state)
    }

    pub fn tokens(&self, seq: SeqId) -> Result<&[u32], KvError> {
        Ok(&self.get(seq)?.tokens)
    }

    /// Leading tokens of `seq` whose KV was computed: the next forward pass starts here, and
    /// this is the position of its first token.
    pub fn computed(&self, seq: SeqId) -> Result<usize, KvError> {
        Ok(self.get(seq)?.computed)
    }

    /// Keys `seq` holds: its computed tokens less those evicted; the key index of its next token.
    pub fn keys(&self, seq: SeqId) -> Result<usize, KvError> {
        Ok(self.get(seq)?.keys())
    }

    /// Computed tokens of `seq` whose KV compaction dropped.
    pub fn evicted(&self, seq: SeqId) -> Result<usize, KvError> {
        Ok(self.get(seq)?.evicted)
    }

    /// Leading keys of an evicting `seq` in shared blocks, which compaction must keep in place
    /// (0 for a sequence that does not evict).
    pub fn frozen(&self, seq: SeqId) -> Result<usize, KvError> {
        Ok(self.get(seq)?.frozen)
    }

    /// Whether `seq` was admitted to evict (and so publishes no blocks for sharing).
    pub fn is_evicting(&self, seq: SeqId) -> Result<bool, KvError> {
        Ok(self.get(seq)?.evicting)
    }

    /// The blocks of `seq` in key order: key index `i` lives in block `table[i / block_size]`,
    /// slot `i % block_size` (the key index of position `p` is `p` until compaction).
    pub fn block_table(&self, seq: SeqId) -> Result<&[u32], KvError> {
        Ok(&self.get(seq)?.blocks)
    }

    /// The KV slot (`block * block_size + offset`) of each position in `positions`, which must
    /// not be evicted and must lie within the reserved blocks.
    pub fn slots(&self, seq: SeqId, positions: Range<usize>) -> Result<Vec<u32>, KvError> {
        let s = self.get(seq)?;
        let bs = self.block_size;
        if s.evicted > 0 && !positions.is_empty() && positions.start < s.computed {
            return Err(KvError::OutOfRange {
                seq,
                len: positions.start,
                limit: s.computed,
                what: "computed tokens of a compacted sequence",
            });
        }
        let keys_end = positions.end.saturating_sub(s.evicted);
        check_len(seq, keys_end, s.blocks.len() * bs, "reserved slots")?;
        Ok(positions
            .map(|p| p - s.evicted)
            .map(|k| s.blocks[k / bs] * bs as u32 + (k % bs) as u32)
            .collect())
    }

    /// Starts a request for `seq` whose full token list (e.g. the whole conversation) is
    /// `tokens`, reusing as much computed KV as is still resident: first the sequence's own
    /// blocks up to the common prefix with its previous tokens (a cache hit), then full blocks
    /// found by hash, from any sequence or from evictable blocks (those alone when they cover
    /// more than the sequence's own). Blocks past the reused prefix
    /// are released. The sequence becomes active, with `computed = cached`.
    ///
    /// A reused block that holds more tokens than are reused must become writable; if another
    /// sequence shares it, it is dropped instead, and up to `block_size - 1` tokens are recomputed.
    ///
    /// Without reuse, every block of the sequence is released and nothing is cached.
    pub fn admit(&mut self, seq: SeqId, tokens: &[u32]) -> Admission {
        self.admit_as(seq, tokens, None)
    }

    /// [`KvManager::admit`] for a sequence whose KV will be compacted ([`KvManager::compact`]):
    /// it reuses at most `max_frozen` tokens of shared blocks found by hash (its frozen prefix,
    /// which compaction keeps, so a budget bounds it) and publishes none of its own. A sequence
    /// that evicted before continues on its compacted KV when `tokens` extends all of its
    /// computed tokens (a session's next turn); otherwise it keeps only its frozen prefix.
    pub fn admit_evicting(&mut self, seq: SeqId, tokens: &[u32], max_frozen: usize) -> Admission {
        self.admit_as(seq, tokens, Some(max_frozen))
    }

    /// Admits `seq`; `evicting` is the frozen-prefix bound of an evicting sequence.
    fn admit_as(&mut self, seq: SeqId, tokens: &[u32], evicting: Option<usize>) -> Admission {
        let bs = self.block_size;
        let max_frozen = evicting.unwrap_or(usize::MAX);
        let evicting = evicting.is_some();
        let mut s = self.seqs.remove(&seq).unwrap_or_else(Sequence::empty);
        if let Some(at) = s.idle_since.take() {
            self.idle.remove(&at);
        }
        if s.evicting {
            let continues = evicting
                && s.state != SeqState::Evicted
                && s.computed < tokens.len()
                && tokens.starts_with(&s.tokens[..s.computed]);
            if continues {
                s.tokens = tokens.to_vec();
                s.state = SeqState::Active;
                let cached = s.computed;
                self.seqs.insert(seq, s);
                return Admission { cached };
            }
            s.forget_evictions(&mut self.cache, bs);
        }
        if !self.reuse {
            self.release_from(&mut s.blocks, 0);
            s.tokens = tokens.to_vec();
            s.computed = 0;
            s.state = SeqState::Active;
            s.evicting = evicting;
            s.max_frozen = if evicting { max_frozen } else { 0 };
            self.seqs.insert(seq, s);
            return Admission { cached: 0 };
        }
        let limit = tokens.len().saturating_sub(1).min(max_frozen / bs * bs);
        let common = s
            .tokens
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count()
            .min(s.computed)
            .min(limit);
        // A longer prefix that other sequences computed beats the sequence's own.
        let common = match self.resident_prefix(tokens).min(limit) > common {
            true => 0,
            false => common,
        };

        // The sequence's own blocks, up to the common prefix.
        let mut cached = common;
        self.release_from(&mut s.blocks, common.div_ceil(bs));
        if let Some(&last) = s.blocks.last().filter(|_| common % bs != 0) {
            if self.cache.hash(last).is_some() {
                if self.cache.refs(last) == 1 {
                    self.cache.unregister(last);
                } else {
                    s.blocks.pop();
                    self.cache.release(last);
                    cached = s.blocks.len() * bs;
                }
            }
        }

        // Then full blocks that any sequence computed, by chained hash.
        if cached % bs == 0 {
            let mut parent = match s.blocks.last() {
                None => Some(None),
                Some(&b) => self.cache.hash(b).map(Some),
            };
            while let Some(p) = parent {
                let i = s.blocks.len();
                if (i + 1) * bs > limit {
                    break;
                }
                let chunk = &tokens[i * bs..(i + 1) * bs];
                let hash = self.cache.chain_hash(p, chunk);
                let Some(id) = self.cache.lookup(hash, p, chunk) else {
                    break;
                };
                self.cache.retain(id);
                s.blocks.push(id);
                parent = Some(Some(hash));
            }
            cached = s.blocks.len() * bs;
        }

        s.tokens = tokens.to_vec();
        s.computed = cached;
        s.state = SeqState::Active;
        s.evicting = evicting;
        s.max_frozen = if evicting { max_frozen } else { 0 };
        s.frozen = if evicting { cached / bs * bs } else { 0 };
        self.seqs.insert(seq, s);
        Admission { cached }
    }

    /// Leading tokens of `tokens` whose KV a new sequence would find resident by hash, in whole
    /// blocks and below the token count, as [`KvManager::admit`] would reuse them (0 without
    /// reuse). Changes nothing.
    pub fn resident_prefix(&self, tokens: &[u32]) -> usize {
        if !self.reuse {
            return 0;
        }
        let bs = self.block_size;
        let limit = tokens.len().saturating_sub(1);
        let mut parent = None;
        let mut blocks = 0;
        while (blocks + 1) * bs <= limit {
            let chunk = &tokens[blocks * bs..(blocks + 1) * bs];
            let hash = self.cache.chain_hash(parent, chunk);
            if self.cache.lookup(hash, parent, chunk).is_none() {
                break;
            }
            parent = Some(hash);
            blocks += 1;
        }
        blocks * bs
    }

    /// Re-admits `seq` with its own tokens, e.g. after [`KvManager::preempt`], evicting as it
    /// was admitted.
    pub fn resume(&mut self, seq: SeqId) -> Result<Admission, KvError> {
        let s = self.get(seq)?;
        let (tokens, frozen) = (s.tokens.clone(), s.evicting.then_some(s.max_frozen));
        Ok(self.admit_as(seq, &tokens, frozen))
    }

    /// Makes the table of the active `seq` cover `upto` tokens. Takes free blocks first, then
    /// evictable ones (least recently released first), then evicts idle sequences (least recently
    /// finished first). All or nothing: on `OutOfBlocks` nothing changed, nothing was evicted.
    pub fn reserve(&mut self, seq: SeqId, upto: usize) -> Result<(), KvError> {
        let s = self.active(seq)?;
        let have = s.blocks.len();
        let needed = upto
            .saturating_sub(s.evicted)
            .div_ceil(self.block_size)
            .saturating_sub(have);
        if needed == 0 {
            return Ok(());
        }
        self.make_room(needed)?;
        let s = self.seqs.get_mut(&seq).expect("checked active above");
        for _ in 0..needed {
            s.blocks
                .push(self.cache.take().expect("make_room freed enough blocks"));
        }
        Ok(())
    }

    /// Blocks [`KvManager::reserve`] of `upto` tokens would add to the active `seq`'s table.
    pub fn blocks_to_reserve(&self, seq: SeqId, upto: usize) -> Result<usize, KvError> {
        let s = self.active(seq)?;
        Ok(upto
            .saturating_sub(s.evicted)
            .div_ceil(self.block_size)
            .saturating_sub(s.blocks.len()))
    }

    /// Whether [`KvManager::reserve`] of `upto` tokens for `seq` would succeed.
    pub fn can_reserve(&self, seq: SeqId, upto: usize) -> bool {
        self.active(seq).is_ok_and(|s| {
            let needed = upto
                .saturating_sub(s.evicted)
                .div_ceil(self.block_size)
                .saturating_sub(s.blocks.len());
            needed <= self.num_free() + self.num_evictable() + self.reclaimable_from_idle()
        })
    }

    /// Records that the KV of the tokens before `computed_upto` is written. Blocks this fills get
    /// hashed and become findable for prefix sharing (and read-only), unless reuse is off.
    pub fn commit(&mut self, seq: SeqId, computed_upto: usize) -> Result<(), KvError> {
        let bs = self.block_size;
        let s = self.active(seq)?;
        check_len(seq, computed_upto, s.tokens.len(), "tokens")?;
        check_len(
            seq,
            computed_upto.saturating_sub(s.evicted),
            s.blocks.len() * bs,
            "reserved slots",
        )?;
        if computed_upto < s.computed {
            return Err(KvError::CommitBackwards {
                seq,
                computed: s.computed,
                upto: computed_upto,
            });
        }
        let s = self.seqs.get_mut(&seq).expect("checked active above");
        // Without reuse no block is ever hashed, so none can be found or shared; an evicting
        // sequence publishes none of its own.
        let hash_upto = if self.reuse && !s.evicting {
            computed_upto / bs
        } else {
            0
        };
        for i in s.computed / bs..hash_upto {
            let parent = match i {
                0 => None,
                _ => match self.cache.hash(s.blocks[i - 1]) {
                    Some(h) => Some(h),
                    None => unreachable!("a full computed block is hashed"),
                },
            };
            let chunk = &s.tokens[i * bs..(i + 1) * bs];
            let hash = self.cache.chain_hash(parent, chunk);
            self.cache.register(s.blocks[i], hash, parent, chunk);
        }
        s.computed = computed_upto;
        Ok(())
    }

    /// Appends a generated token to the active `seq`; its KV is computed by the next step.
    pub fn append_token(&mut self, seq: SeqId, token: u32) -> Result<(), KvError> {
        self.active(seq)?;
        self.seqs
            .get_mut(&seq)
            .expect("checked active above")
            .tokens
            .push(token);
        Ok(())
    }

    /// Ends the request of the active `seq`: it stays resident (idle) for its next turn, until its
    /// blocks are needed. Reserved blocks past its computed tokens are released. Without reuse it
    /// keeps only its tokens (evicted), as its blocks would never be used again.
    pub fn finish(&mut self, seq: SeqId) -> Result<(), KvError> {
        if !self.reuse {
            return self.preempt(seq);
        }
        self.active(seq)?;
        let mut s = self.seqs.remove(&seq).expect("checked active above");
        let keep = s.keys().div_ceil(self.block_size);
        self.release_from(&mut s.blocks, keep);
        self.clock += 1;
        s.idle_since = Some(self.clock);
        s.state = SeqState::Idle;
        self.idle.insert(self.clock, seq);
        self.seqs.insert(seq, s);
        Ok(())
    }

    /// Forgets `seq` in any state (cancelled, or its conversation is over): its blocks are released
    /// at once, though full ones stay findable by hash until reallocated.
    pub fn free(&mut self, seq: SeqId) -> Result<(), KvError> {
        let mut s = self.remove(seq)?;
        self.release_from(&mut s.blocks, 0);
        Ok(())
    }

    /// Takes `seq` off the books (and out of the idle order); its blocks are still held.
    fn remove(&mut self, seq: SeqId) -> Result<Sequence, KvError> {
        let s = self
            .seqs
            .remove(&seq)
            .ok_or(KvError::UnknownSequence(seq))?;
        if let Some(at) = s.idle_since {
            self.idle.remove(&at);
        }
        Ok(s)
    }

    /// Forgets `seq` as [`KvManager::free`] does, and makes the blocks it held alone unfindable
    /// by hash, so that no later sequence reuses them: for KV that must not be trusted (the step
    /// that wrote it gave no finite logit). Blocks other sequences share stay as they are: they
    /// hold them, computed by whichever sequence came first.
    pub fn discard(&mut self, seq: SeqId) -> Result<(), KvError> {
        let mut s = self.remove(seq)?;
        for &b in &s.blocks {
            if self.cache.refs(b) == 1 {
                self.cache.unregister(b);
            }
        }
        self.release_from(&mut s.blocks, 0);
        Ok(())
    }

    /// Takes the blocks of the active `seq` (to let others run); it keeps its tokens with
    /// `computed = 0`. [`KvManager::resume`] later re-attaches what is still findable.
    pub fn preempt(&mut self, seq: SeqId) -> Result<(), KvError> {
        self.active(seq)?;
        let mut s = self.seqs.remove(&seq).expect("checked active above");
        self.release_from(&mut s.blocks, 0);
        s.computed = 0;
        s.evicted = 0;
        s.state = SeqState::Evicted;
        self.seqs.insert(seq, s);
        Ok(())
    }

    /// Records a compaction of the active, evicting `seq`: the backend moved the `kept` keys each
    /// (layer, KV head) keeps to key indices `0..kept`, so the sequence now holds `kept` keys and
    /// the blocks past them go back to the pool. `kept` must lie between the frozen prefix and
    /// the keys held.
    pub fn compact(&mut self, seq: SeqId, kept: usize) -> Result<(), KvError> {
        let s = self.active(seq)?;
        if !s.evicting || kept < s.frozen || kept > s.keys() {
            return Err(KvError::BadCompaction {
                seq,
                kept,
                frozen: s.frozen,
                keys: s.keys(),
                evicting: s.evicting,
            });
        }
        let mut s = self.seqs.remove(&seq).expect("checked active above");
        s.evicted += s.keys() - kept;
        let keep = kept.div_ceil(self.block_size);
        self.release_from(&mut s.blocks, keep);
        self.seqs.insert(seq, s);
        Ok(())
    }

    /// Starts `child` (which must not exist) as a copy of `parent` (in any state) for parallel
    /// sampling: it gets the parent's tokens and shares the parent's full computed blocks. The KV
    /// of the parent's partial last block is not shared (the child will write there), so the child
    /// recomputes those tokens: `child.computed` is the full-block prefix, capped below the token
    /// count like [`Admission::cached`]. The child is active.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<Admission, KvError> {
        if self.seqs.contains_key(&child) {
            return Err(KvError::SequenceExists(child));
        }
        let p = self.get(parent)?;
        let bs = self.block_size;
        let shared = match (self.reuse, p.evicting) {
            (true, false) => p.computed.min(p.tokens.len().saturating_sub(1)) / bs,
            // Only the frozen prefix of an evicting parent holds what its tokens say.
            (true, true) => (p.frozen / bs).min(p.blocks.len()),
            (false, _) => 0,
        };
        let blocks = p.blocks[..shared].to_vec();
        let tokens = p.tokens.clone();
        for &b in &blocks {
            self.cache.retain(b);
        }
        let cached = shared * bs;
        self.seqs.insert(
            child,
            Sequence {
                tokens,
                blocks,
                computed: cached,
                state: SeqState::Active,
                idle_since: None,
                evicting: false,
                frozen: 0,
                max_frozen: 0,
                evicted: 0,
            },
        );
        Ok(Admission { cached })
    }

    /// Verifies every invariant; for tests and debug assertions.
    pub fn check(&self) -> Result<(), String> {
        let bs = self.block_size;
        let mut table_refs = vec![0u32; self.total()];
        for (&id, s) in &self.seqs {
            let err = |m: String| Err(format!("sequence {id}: {m}"));
            for &b in &s.blocks {
                match table_refs.get_mut(b as usize) {
                    Some(n) => *n += 1,
                    None => return err(format!("block {b} out of range")),
                }
            }
            let mut sorted = s.blocks.clone();
            sorted.sort_unstable();
            sorted.dedup();
            if sorted.len() != s.blocks.len() {
                return err("a block appears twice in its table".into());
            }
            if !s.evicting && (s.evicted > 0 || s.frozen > 0) {
                return err("evicted or frozen keys without eviction".into());
            }
            if s.evicted > s.computed || s.frozen > s.keys() && s.state != SeqState::Evicted {
                return err(format!(
                    "{} evicted and {} frozen of {} computed",
                    s.evicted, s.frozen, s.computed
                ));
            }
            if s.computed > s.tokens.len() || s.keys() > s.blocks.len() * bs {
                return err(format!(
                    "computed {} past its {} tokens or {} blocks",
                    s.computed,
                    s.tokens.len(),
                    s.blocks.len()
                ));
            }
            match s.state {
                SeqState::Active if s.idle_since.is_none() => {}
                SeqState::Idle
                    if self.reuse
                        && s.idle_since.and_then(|at| self.idle.get(&at)) == Some(&id)
                        && s.blocks.len() == s.keys().div_ceil(bs) => {}
                SeqState::Evicted
                    if s.idle_since.is_none() && s.blocks.is_empty() && s.computed == 0 => {}
                state => return err(format!("inconsistent {state:?} state")),
            }
            // Hashed, shareable blocks: the full computed ones, or an evicting sequence's frozen
            // prefix (which it never rewrites).
            let full = if s.evicting {
                s.frozen / bs
            } else {
                s.computed / bs
            };
            let mut parent = None;
            for (i, &b) in s.blocks.iter().enumerate() {
                let hash = self.cache.hash(b);
                if i < full && !self.reuse {
                    if hash.is_some() || self.cache.refs(b) != 1 {
                        return err(format!("block {i} ({b}) is shared with reuse off"));
                    }
                } else if i < full {
                    let expect = self
                        .cache
                        .chain_hash(parent, &s.tokens[i * bs..(i + 1) * bs]);
                    if hash != Some(expect) {
                        return err(format!("full block {i} ({b}) is not hashed by its tokens"));
                    }
                    parent = Some(expect);
                } else if hash.is_some() || self.cache.refs(b) != 1 {
                    return err(format!("partial or uncomputed block {i} ({b}) is shared"));
                }
            }
        }
        for (&at, &id) in &self.idle {
            if self.seqs.get(&id).and_then(|s| s.idle_since) != Some(at) {
                return Err(format!(
                    "idle entry {at} -> {id} disagrees with the sequence"
                ));
            }
        }
        self.cache.check(&table_refs)
    }

    fn get(&self, seq: SeqId) -> Result<&Sequence, KvError> {
        self.seqs.get(&seq).ok_or(KvError::UnknownSequence(seq))
    }

    fn active(&self, seq: SeqId) -> Result<&Sequence, KvError> {
        let s = self.get(seq)?;
        match s.state {
            SeqState::Active => Ok(s),
            state => Err(KvError::NotActive { seq, state }),
        }
    }

    /// Releases `blocks[keep..]`, last first, so that a sequence's tail is reallocated before its
    /// prefix (a prefix is useful without its tail, not the reverse).
    fn release_from(&mut self, blocks: &mut Vec<u32>, keep: usize) {
        while blocks.len() > keep {
            let b = blocks.pop().expect("len > keep");
            self.cache.release(b);
        }
    }

    /// Blocks that would become free or evictable if every idle sequence were evicted.
    fn reclaimable_from_idle(&self) -> usize {
        let mut idle_refs: HashMap<u32, u32> = HashMap::new();
        for id in self.idle.values() {
            for &b in &self.seqs[id].blocks {
                *idle_refs.entry(b).or_default() += 1;
            }
        }
        idle_refs
            .iter()
            .filter(|&(&b, &n)| self.cache.refs(b) == n)
            .count()
    }

    /// Evicts idle sequences until `needed` blocks can be taken, or fails having evicted none.
    fn make_room(&mut self, needed: usize) -> Result<(), KvError> {
        let ready = self.num_free() + self.num_evictable();
        if ready >= needed {
            return Ok(());
        }
        let reclaimable = self.reclaimable_from_idle();
        if ready + reclaimable < needed {
            return Err(KvError::OutOfBlocks {
                needed,
                free: ready + reclaimable,
                total: self.total(),
            });
        }
        while self.num_free() + self.num_evictable() < needed {
            let Some((_, victim)) = self.idle.pop_first() else {
                unreachable!("the idle sequences hold enough blocks")
            };
            let mut s = self
                .seqs
                .remove(&victim)
                .expect("idle entries are sequences");
            self.release_from(&mut s.blocks, 0);
            s.computed = 0;
            s.evicted = 0;
            s.idle_since = None;
            s.state = SeqState::Evicted;
            self.seqs.insert(victim, s);
        }
        Ok(())
    }
}

fn check_len(seq: SeqId, len: usize, limit: usize, what: &'static str) -> Result<(), KvError> {
    if len > limit {
        return Err(KvError::OutOfRange {
            seq,
            len,
            limit,
            what,
        });
    }
    Ok(())
}
