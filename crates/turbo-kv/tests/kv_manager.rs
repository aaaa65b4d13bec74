//! `KvManager` against a reference model of the KV data: the tests record, per block id, what was
//! "written" into each slot when the manager said it was computed, and check that every sequence's
//! computed positions map to slots holding its own KV. That is what makes prefix reuse correct: a
//! reused or shared block must hold exactly the KV it is reused for. The KV of position `p`
//! depends on all of `tokens[..=p]` (attention looks back), so that whole prefix is what a slot
//! records: equal tokens after a different prefix are different KV.

use proptest::prelude::*;
use std::collections::HashMap;
use turbo_kv::{KvError, KvManager, SeqId, SeqState};

/// The KV "data": per block, per slot, the tokens up to and including the one whose KV it holds.
#[derive(Default)]
struct Written(HashMap<u32, Vec<Option<Vec<u32>>>>);

impl Written {
    /// Commits `seq` up to `upto`, recording the writes a model's forward pass would make.
    fn commit(&mut self, m: &mut KvManager, seq: SeqId, upto: usize) -> Result<(), String> {
        let bs = m.block_size();
        let from = m.computed(seq).map_err(|e| e.to_string())?;
        let evicted = m.evicted(seq).map_err(|e| e.to_string())?;
        let table = m.block_table(seq).map_err(|e| e.to_string())?.to_vec();
        let tokens = m.tokens(seq).map_err(|e| e.to_string())?.to_vec();
        for p in from..upto.min(tokens.len()) {
            let key = p - evicted;
            let block = table[key / bs];
            if m.ref_count(block) != 1 {
                return Err(format!(
                    "seq {seq} writes position {p} into shared block {block}"
                ));
            }
            self.0.entry(block).or_insert_with(|| vec![None; bs])[key % bs] =
                Some(tokens[..=p].to_vec());
        }
        m.commit(seq, upto).map_err(|e| e.to_string())
    }

    /// Runs a forward pass over all of `seq`'s uncomputed tokens.
    fn step(&mut self, m: &mut KvManager, seq: SeqId) -> Result<(), KvError> {
        let len = m.tokens(seq)?.len();
        m.reserve(seq, len)?;
        self.commit(m, seq, len).expect("commit after reserve");
        Ok(())
    }

    /// Moves the KV of `kept` key indices of `seq` to its leading ones, in order, as a backend's
    /// compaction does, then records it in the manager.
    fn compact(&mut self, m: &mut KvManager, seq: SeqId, kept: &[usize]) -> Result<(), String> {
        let bs = m.block_size();
        let table = m.block_table(seq).map_err(|e| e.to_string())?.to_vec();
        let allowed = m.state(seq) == Some(SeqState::Active) && m.is_evicting(seq).unwrap();
        for (to, &from) in kept.iter().enumerate().filter(|_| allowed) {
            if to == from {
                continue;
            }
            let block = table[to / bs];
            if m.ref_count(block) != 1 {
                return Err(format!("seq {seq} compacts into shared block {block}"));
            }
            let held = self
                .0
                .get(&table[from / bs])
                .and_then(|b| b[from % bs].clone());
            self.0.entry(block).or_insert_with(|| vec![None; bs])[to % bs] = held;
        }
        m.compact(seq, kept.len()).map_err(|e| e.to_string())
    }

    /// Every sequence's computed positions hold its tokens; a compacted sequence's keys hold the
    /// KV of some of its positions, in order, its frozen prefix all of its first ones.
    fn verify(&self, m: &KvManager, seqs: impl IntoIterator<Item = SeqId>) -> Result<(), String> {
        let bs = m.block_size();
        for seq in seqs {
            let (Ok(tokens), Ok(table), Ok(computed)) =
                (m.tokens(seq), m.block_table(seq), m.computed(seq))
            else {
                continue;
            };
            if m.evicted(seq).unwrap() > 0 {
                let (keys, frozen) = (m.keys(seq).unwrap(), m.frozen(seq).unwrap());
                let mut last = 0;
                for i in 0..keys {
                    let held = self
                        .0
                        .get(&table[i / bs])
                        .and_then(|b| b[i % bs].as_deref());
                    let len = match held {
                        Some(h) if tokens.starts_with(h) && h.len() > last => h.len(),
                        _ => return Err(format!("seq {seq} key {i} holds {held:?}")),
                    };
                    if i < frozen && len != i + 1 {
                        return Err(format!("seq {seq} frozen key {i} moved"));
                    }
                    last = len;
                }
                continue;
            }
            for p in 0..computed {
                let block = table[p / bs];
                let held = self
                    .0
                    .get(&block)
                    .and_then(|slots| slots[p % bs].as_deref());
                if held != Some(&tokens[..=p]) {
                    return Err(format!(
                        "seq {seq} position {p}: block {block} slot {} holds the KV of {held:?}, \
                         not of {:?}",
                        p % bs,
                        &tokens[..=p]
                    ));
                }
            }
        }
        Ok(())
    }
}

fn range(n: u32) -> Vec<u32> {
    (0..n).collect()
}

#[test]
fn sequences_sharing_a_system_prompt_share_its_blocks() {
    let mut m = KvManager::new(32, 4);
    let mut w = Written::default();
    let system = range(12);
    let a: Vec<u32> = system
        .iter()
        .copied()
        .chain([100, 101, 102, 103, 104])
        .collect();
    let b: Vec<u32> = system
        .iter()
        .copied()
        .chain([200, 201, 202, 203, 204, 205])
        .collect();

    assert_eq!(m.admit(1, &a).cached, 0);
    assert_eq!(m.resident_prefix(&b), 0, "nothing is computed yet");
    w.step(&mut m, 1).unwrap();
    assert_eq!(m.resident_prefix(&b), 12);
    assert_eq!(
        m.resident_prefix(&b[..12]),
        8,
        "the last token is always run"
    );
    assert_eq!(
        m.admit(2, &b).cached,
        12,
        "the system prompt's three blocks are reused"
    );
    w.step(&mut m, 2).unwrap();

    let (ta, tb) = (m.block_table(1).unwrap(), m.block_table(2).unwrap());
    assert_eq!(ta[..3], tb[..3]);
    assert!(ta[3..].iter().all(|x| !tb.contains(x)));
    for &block in &ta[..3] {
        assert_eq!(m.ref_count(block), 2);
    }
    let unshared = a.len().div_ceil(4) + b.len().div_ceil(4);
    assert_eq!(m.num_used(), unshared - 3);
    w.verify(&m, [1, 2]).unwrap();
    m.check().unwrap();
}

/// A discarded sequence's own blocks are never found again; blocks it shares stay with their
/// other holders; a freed sequence's full blocks stay findable.
#[test]
fn discarded_blocks_are_never_reused() {
    let mut m = KvManager::new(32, 4);
    let mut w = Written::default();
    let a: Vec<u32> = range(16).into_iter().chain([100, 101]).collect();
    let b: Vec<u32> = range(8).into_iter().chain([200]).collect();
    m.admit(1, &a);
    w.step(&mut m, 1).unwrap();
    assert_eq!(m.admit(2, &b).cached, 8, "b shares a's first two blocks");
    w.step(&mut m, 2).unwrap();
    m.discard(1).unwrap();
    assert_eq!(m.state(1), None);
    assert_eq!(
        m.resident_prefix(&a),
        8,
        "only the blocks b holds are findable"
    );
    w.verify(&m, [2]).unwrap();
    m.check().unwrap();
    // Freed instead, all of a's full blocks stay findable.
    m.admit(3, &a);
    w.step(&mut m, 3).unwrap();
    m.free(3).unwrap();
    assert_eq!(m.resident_prefix(&a), 16);
    m.check().unwrap();
}

#[test]
fn without_reuse_nothing_is_shared_or_kept() {
    let mut m = KvManager::without_reuse(32, 4);
    let mut w = Written::default();
    let a: Vec<u32> = range(12).into_iter().chain([100, 101]).collect();
    let b: Vec<u32> = range(12).into_iter().chain([200]).collect();
    assert_eq!(m.admit(1, &a).cached, 0);
    w.step(&mut m, 1).unwrap();
    assert_eq!(m.admit(2, &b).cached, 0, "the common prefix is not shared");
    w.step(&mut m, 2).unwrap();
    let (ta, tb) = (m.block_table(1).unwrap(), m.block_table(2).unwrap());
    assert!(ta.iter().all(|x| !tb.contains(x)));
    assert_eq!(m.num_used(), a.len().div_ceil(4) + b.len().div_ceil(4));
    assert_eq!(m.fork(1, 3).unwrap().cached, 0);
    m.free(3).unwrap();

    // A finished sequence keeps nothing: its next turn recomputes everything.
    m.finish(1).unwrap();
    assert_eq!(m.state(1), Some(SeqState::Evicted));
    assert_eq!(m.num_cached_idle(), 0);
    let mut next_turn = a.clone();
    next_turn.extend([300, 301]);
    assert_eq!(m.admit(1, &next_turn).cached, 0);
    w.step(&mut m, 1).unwrap();
    w.verify(&m, [1, 2]).unwrap();
    m.check().unwrap();
    m.free(1).unwrap();
    m.free(2).unwrap();
    assert_eq!((m.num_used(), m.num_evictable()), (0, 0));
    m.check().unwrap();
}

#[test]
fn an_idle_sequence_hits_the_cache_on_its_next_turn() {
    let mut m = KvManager::new(16, 4);
    let mut w = Written::default();
    let prompt = range(10);
    m.admit(7, &prompt);
    w.step(&mut m, 7).unwrap();
    // Three generated tokens; the last one's KV is never computed (generation stopped there).
    for t in [50, 51, 52] {
        m.append_token(7, t).unwrap();
        if t != 52 {
            w.step(&mut m, 7).unwrap();
        }
    }
    assert_eq!(m.computed(7).unwrap(), 12);
    let table = m.block_table(7).unwrap().to_vec();
    m.finish(7).unwrap();
    assert_eq!(m.state(7), Some(SeqState::Idle));
    assert_eq!(m.num_cached_idle(), 1);

    let mut next_turn = m.tokens(7).unwrap().to_vec();
    next_turn.extend([60, 61, 62, 63, 64]);
    assert_eq!(m.admit(7, &next_turn).cached, 12);
    assert_eq!(m.block_table(7).unwrap(), &table[..]);
    assert_eq!(m.num_cached_idle(), 0);
    w.step(&mut m, 7).unwrap();
    w.verify(&m, [7]).unwrap();
    m.check().unwrap();
}

#[test]
fn an_evicted_sequence_keeps_only_its_still_hashed_prefix() {
    let mut m = KvManager::new(4, 4);
    let mut w = Written::default();
    let conv = range(10);
    m.admit(1, &conv);
    w.step(&mut m, 1).unwrap(); // two full blocks and a partial one
    m.finish(1).unwrap();

    // Another sequence needs two blocks; one is free, so sequence 1 is evicted. Its tail goes
    // first (the partial block, which is plain free), its two full blocks stay findable.
    m.admit(2, &[90, 91, 92, 93]);
    m.reserve(2, 8).unwrap();
    assert_eq!(m.state(1), Some(SeqState::Evicted));
    assert_eq!(m.num_evictable(), 2);
    w.commit(&mut m, 2, 4).unwrap();
    m.free(2).unwrap();

    let mut longer = conv.clone();
    longer.extend([10, 11]);
    assert_eq!(
        m.admit(1, &longer).cached,
        8,
        "the hash-resident prefix is re-attached"
    );
    w.verify(&m, [1]).unwrap();
    m.finish(1).unwrap();

    // A sequence that needs the whole pool evicts sequence 1 and reallocates all its blocks.
    m.admit(3, &range(16).iter().map(|t| t + 500).collect::<Vec<_>>());
    m.reserve(3, 16).unwrap();
    m.free(3).unwrap();
    assert_eq!(m.admit(1, &longer).cached, 0, "a full miss: re-prefill");
    m.check().unwrap();
}

#[test]
fn readmitting_the_same_tokens_recomputes_only_the_last_unshared_block() {
    let mut m = KvManager::new(8, 4);
    let mut w = Written::default();
    m.admit(1, &range(8));
    w.step(&mut m, 1).unwrap();
    // Another sequence with the same tokens may reuse one block: the second would claim the last
    // token, whose logits it needs.
    assert_eq!(m.admit(2, &range(8)).cached, 4);
    m.free(2).unwrap();
    // Its own last block is not shared, so it becomes writable again for the last token.
    assert_eq!(m.admit(1, &range(8)).cached, 7);
    w.step(&mut m, 1).unwrap();
    // Once another sequence shares that block it is read-only, so the whole block is recomputed.
    assert_eq!(m.admit(2, &range(9)).cached, 8);
    assert_eq!(m.admit(1, &range(8)).cached, 4);
    w.step(&mut m, 1).unwrap();
    w.verify(&m, [1, 2]).unwrap();
    m.check().unwrap();
}

#[test]
fn fork_shares_full_blocks_and_recomputes_the_partial_one() {
    let mut m = KvManager::new(8, 4);
    let mut w = Written::default();
    m.admit(1, &range(10));
    w.step(&mut m, 1).unwrap();
    assert_eq!(m.fork(1, 2).unwrap().cached, 8);
    assert_eq!(m.fork(1, 2), Err(KvError::SequenceExists(2)));
    let parent = m.block_table(1).unwrap().to_vec();
    assert_eq!(m.block_table(2).unwrap(), &parent[..2]);
    assert_eq!(m.ref_count(parent[0]), 2);
    assert_eq!(m.ref_count(parent[2]), 1);
    m.append_token(2, 77).unwrap();
    w.step(&mut m, 2).unwrap();
    m.append_token(1, 88).unwrap();
    w.step(&mut m, 1).unwrap();
    w.verify(&m, [1, 2]).unwrap();
    m.check().unwrap();
}

#[test]
fn a_failed_reserve_evicts_nothing() {
    let mut m = KvManager::new(4, 4);
    let mut w = Written::default();
    m.admit(1, &range(8));
    w.step(&mut m, 1).unwrap();
    m.finish(1).unwrap();
    m.admit(2, &[9]);
    let err = m.reserve(2, 100).unwrap_err();
    assert_eq!(
        err,
        KvError::OutOfBlocks {
            needed: 25,
            free: 4,
            total: 4
        }
    );
    assert_eq!(m.state(1), Some(SeqState::Idle));
    assert_eq!(m.num_used(), 2);
    assert!(matches!(m.commit(2, 1), Err(KvError::OutOfRange { .. })));
    assert!(matches!(
        m.append_token(1, 0),
        Err(KvError::NotActive {
            seq: 1,
            state: SeqState::Idle
        })
    ));
    m.check().unwrap();
}

/// A tiny deterministic generator, so the stress test needs no extra dependency.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

#[test]
fn stress_a_small_pool_then_free_everything() {
    let mut m = KvManager::new(16, 4);
    let mut w = Written::default();
    let mut rng = Lcg(42);
    let prefix = range(9);
    for _ in 0..1000 {
        let seq = rng.below(8);
        match rng.below(8) {
            0 | 1 => {
                let mut tokens = match m.tokens(seq) {
                    Ok(t) if rng.below(2) == 0 => t.to_vec(),
                    _ => prefix[..rng.below(10) as usize].to_vec(),
                };
                tokens.extend((0..1 + rng.below(6)).map(|_| rng.below(3) as u32));
                let a = m.admit(seq, &tokens);
                assert!(a.cached < tokens.len());
            }
            2 | 3 => match w.step(&mut m, seq) {
                Ok(()) | Err(KvError::OutOfBlocks { .. }) => {}
                Err(KvError::NotActive { .. } | KvError::UnknownSequence(_)) => {}
                Err(e) => panic!("{e}"),
            },
            4 => {
                let _ = m.append_token(seq, rng.below(3) as u32);
            }
            5 => {
                let _ = m.finish(seq);
            }
            6 => {
                let _ = match rng.below(3) {
                    0 => m.free(seq),
                    1 => m.preempt(seq),
                    _ => m.resume(seq).map(drop),
                };
            }
            _ => {
                let _ = m.fork(seq, rng.below(8));
            }
        }
        m.check().unwrap();
        w.verify(&m, 0..8).unwrap();
    }
    for seq in 0..8 {
        let _ = m.free(seq);
    }
    m.check().unwrap();
    assert_eq!(m.num_sequences(), 0);
    assert_eq!(m.num_used(), 0);
    assert_eq!(m.num_free() + m.num_evictable(), m.total());
}

#[derive(Debug, Clone)]
enum Op {
    /// Admit with one of the shared prefixes and a random tail.
    Admit(SeqId, usize, Vec<u32>),
    /// Admit with the sequence's own tokens and a random tail: the conversation's next turn.
    Continue(SeqId, Vec<u32>),
    Reserve(SeqId, usize),
    /// Commit this fraction (of 4) of the uncomputed, reserved tokens.
    Commit(SeqId, usize),
    /// Reserve and commit everything: a forward pass.
    Step(SeqId),
    Append(SeqId, u32),
    Finish(SeqId),
    Free(SeqId),
    Preempt(SeqId),
    Resume(SeqId),
    Fork(SeqId, SeqId),
    /// Admit to evict, with one of the shared prefixes and a random tail, or (`None`) with the
    /// sequence's own tokens and the tail.
    AdmitEvicting(SeqId, Option<usize>, Vec<u32>, usize),
    /// Compact, keeping the frozen prefix and every `stride`-th of the other keys plus the last.
    Compact(SeqId, usize),
}

const SEQS: SeqId = 6;

fn prefixes() -> Vec<Vec<u32>> {
    vec![
        vec![],
        vec![1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2],
        vec![1, 2, 3, 1, 2, 3, 0, 0],
        vec![0; 9],
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let seq = || 0..SEQS;
    let tail = || prop::collection::vec(0u32..3, 0..7);
    prop_oneof![
        3 => (seq(), 0..4usize, tail()).prop_map(|(s, p, t)| Op::Admit(s, p, t)),
        2 => (seq(), tail()).prop_map(|(s, t)| Op::Continue(s, t)),
        2 => (seq(), 0usize..24).prop_map(|(s, n)| Op::Reserve(s, n)),
        2 => (seq(), 0usize..5).prop_map(|(s, f)| Op::Commit(s, f)),
        4 => seq().prop_map(Op::Step),
        2 => (seq(), 0u32..3).prop_map(|(s, t)| Op::Append(s, t)),
        2 => seq().prop_map(Op::Finish),
        1 => seq().prop_map(Op::Free),
        1 => seq().prop_map(Op::Preempt),
        1 => seq().prop_map(Op::Resume),
        1 => (seq(), seq()).prop_map(|(p, c)| Op::Fork(p, c)),
        2 => (seq(), prop::option::of(0..4usize), tail(), 0usize..16)
            .prop_map(|(s, p, t, f)| Op::AdmitEvicting(s, p, t, f)),
        2 => (seq(), 1usize..4).prop_map(|(s, k)| Op::Compact(s, k)),
    ]
}

/// What an all-or-nothing failure must leave unchanged.
fn snapshot(m: &KvManager) -> impl PartialEq + std::fmt::Debug {
    let seqs: Vec<_> = (0..SEQS)
        .map(|s| {
            (
                m.state(s),
                m.block_table(s).map(<[u32]>::to_vec).ok(),
                m.computed(s).ok(),
            )
        })
        .collect();
    (seqs, m.num_free(), m.num_evictable(), m.num_cached_idle())
}

fn apply(m: &mut KvManager, w: &mut Written, op: Op) -> Result<(), TestCaseError> {
    let prefixes = prefixes();
    let readmit = |m: &mut KvManager, seq: SeqId, tokens: Vec<u32>| -> Result<(), TestCaseError> {
        // A resident sequence whose new tokens extend its computed ones hits its own cache. When
        // that would claim the last token, the block holding it may be shared and read-only:
        // then only whole blocks are reused.
        let limit = tokens.len().saturating_sub(1);
        // An evicting sequence's own blocks past its frozen prefix are not reused by a plain
        // admission: they were never published.
        let evicting = m.is_evicting(seq).unwrap_or(false);
        let own_hit = match (m.state(seq), m.tokens(seq), m.computed(seq)) {
            (Some(SeqState::Active | SeqState::Idle), Ok(old), Ok(c))
                if tokens.starts_with(&old[..c]) && !evicting =>
            {
                if c <= limit {
                    c
                } else {
                    limit / m.block_size() * m.block_size()
                }
            }
            _ => 0,
        };
        let resident = m.resident_prefix(&tokens);
        let a = m.admit(seq, &tokens);
        prop_assert!(a.cached < tokens.len() || a.cached == 0);
        // What is findable by hash is reused, whatever the sequence held before.
        prop_assert!(
            a.cached >= resident,
            "cached {} < resident {resident}",
            a.cached
        );
        if m.reuses_kv() {
            prop_assert!(
                a.cached >= own_hit,
                "cached {} < own hit {own_hit}",
                a.cached
            );
        } else {
            prop_assert_eq!(a.cached, 0, "reuse is off");
        }
        prop_assert_eq!(m.computed(seq).unwrap(), a.cached);
        prop_assert_eq!(m.state(seq), Some(SeqState::Active));
        Ok(())
    };
    match op {
        Op::Admit(seq, p, tail) => {
            readmit(m, seq, prefixes[p].iter().copied().chain(tail).collect())?;
        }
        Op::Continue(seq, tail) => {
            let mut tokens = m.tokens(seq).map(<[u32]>::to_vec).unwrap_or_default();
            tokens.extend(tail);
            readmit(m, seq, tokens)?;
        }
        Op::Reserve(seq, upto) => {
            let before = snapshot(m);
            let could = m.can_reserve(seq, upto);
            match m.reserve(seq, upto) {
                Ok(()) => {
                    prop_assert!(could);
                    let keys = upto.saturating_sub(m.evicted(seq).unwrap());
                    prop_assert!(m.block_table(seq).unwrap().len() * m.block_size() >= keys);
                }
                Err(KvError::OutOfBlocks { .. }) => {
                    prop_assert!(!could);
                    prop_assert_eq!(snapshot(m), before);
                }
                Err(_) => prop_assert_eq!(snapshot(m), before),
            }
        }
        Op::Commit(seq, f) => {
            if m.state(seq) == Some(SeqState::Active) {
                let from = m.computed(seq).unwrap();
                let reserved =
                    m.block_table(seq).unwrap().len() * m.block_size() + m.evicted(seq).unwrap();
                let to = reserved.min(m.tokens(seq).unwrap().len());
                let upto = from + (to - from) * f / 4;
                w.commit(m, seq, upto).map_err(TestCaseError::fail)?;
            }
        }
        Op::Step(seq) => {
            let _ = w.step(m, seq);
        }
        Op::Append(seq, t) => {
            let _ = m.append_token(seq, t);
        }
        Op::Finish(seq) => {
            if m.finish(seq).is_ok() && !m.reuses_kv() {
                prop_assert_eq!(m.state(seq), Some(SeqState::Evicted));
                prop_assert!(m.block_table(seq).unwrap().is_empty());
            }
        }
        Op::Free(seq) => {
            let _ = m.free(seq);
            prop_assert_eq!(m.state(seq), None);
        }
        Op::Preempt(seq) => {
            if m.preempt(seq).is_ok() {
                prop_assert!(m.block_table(seq).unwrap().is_empty());
            }
        }
        Op::Resume(seq) => {
            let _ = m.resume(seq);
        }
        Op::AdmitEvicting(seq, p, tail, max_frozen) => {
            let old = m.tokens(seq).map(<[u32]>::to_vec).unwrap_or_default();
            let mut tokens = match p {
                Some(p) => prefixes[p].clone(),
                None => old.clone(),
            };
            tokens.extend(tail);
            let (was, computed) = (m.state(seq), m.computed(seq).unwrap_or(0));
            let continues = m.is_evicting(seq).unwrap_or(false)
                && matches!(was, Some(SeqState::Active | SeqState::Idle))
                && computed < tokens.len()
                && tokens.starts_with(&old[..computed]);
            let resident = m.resident_prefix(&tokens);
            let a = m.admit_evicting(seq, &tokens, max_frozen);
            let bs = m.block_size();
            prop_assert!(a.cached < tokens.len() || a.cached == 0);
            if continues {
                prop_assert_eq!(a.cached, computed, "a compacted sequence continues");
            } else {
                prop_assert!(a.cached >= resident.min(max_frozen / bs * bs));
                prop_assert!(m.frozen(seq).unwrap() <= max_frozen);
                prop_assert_eq!(m.frozen(seq).unwrap(), a.cached / bs * bs);
            }
            prop_assert!(m.is_evicting(seq).unwrap());
            prop_assert_eq!(m.state(seq), Some(SeqState::Active));
        }
        Op::Compact(seq, stride) => {
            let (Ok(keys), Ok(frozen)) = (m.keys(seq), m.frozen(seq)) else {
                return Ok(());
            };
            let kept: Vec<usize> = (0..keys)
                .filter(|&i| i < frozen || (i - frozen) % stride == 0 || i + 1 == keys)
                .collect();
            let active = m.state(seq) == Some(SeqState::Active);
            let evicting = m.is_evicting(seq).unwrap();
            let used = m.num_used();
            let result = w.compact(m, seq, &kept);
            prop_assert_eq!(result.is_ok(), active && evicting, "{:?}", result);
            if result.is_ok() {
                prop_assert_eq!(m.keys(seq).unwrap(), kept.len());
                prop_assert!(m.num_used() <= used, "compaction frees blocks");
                prop_assert_eq!(
                    m.block_table(seq).unwrap().len(),
                    kept.len().div_ceil(m.block_size())
                );
            }
        }
        Op::Fork(parent, child) => {
            if let Ok(a) = m.fork(parent, child) {
                let bs = m.block_size();
                let (p, c) = (
                    m.block_table(parent).unwrap(),
                    m.block_table(child).unwrap(),
                );
                prop_assert_eq!(c, &p[..a.cached / bs]);
                prop_assert!(m.reuses_kv() || a.cached == 0);
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Random interleavings of every operation, with KV reuse on (3 cases in 4) or off.
    #[test]
    fn invariants_and_kv_contents_hold(
        block_size in 1usize..5,
        num_blocks in 2u32..12,
        reuse in prop::bool::weighted(0.75),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let mut m = match reuse {
            true => KvManager::new(num_blocks, block_size),
            false => KvManager::without_reuse(num_blocks, block_size),
        };
        let mut w = Written::default();
        for op in ops {
            apply(&mut m, &mut w, op)?;
            m.check().map_err(TestCaseError::fail)?;
            w.verify(&m, 0..SEQS).map_err(TestCaseError::fail)?;
            prop_assert_eq!(m.num_free() + m.num_evictable() + m.num_used(), m.total());
        }
        for seq in 0..SEQS {
            let _ = m.free(seq);
        }
        m.check().map_err(TestCaseError::fail)?;
        prop_assert_eq!(m.num_used(), 0);
    }
}
