//! Collectives between the ranks of a tensor-parallel model.
//!
//! A tensor-parallel forward pass runs on every rank at once (one thread each) and meets the
//! others only in collectives: after each row-parallel product, every rank holds a partial sum of
//! the residual stream and [`Backend::all_reduce_sum`](crate::Backend::all_reduce_sum) makes it
//! whole on all of them. Each backend reaches its peers in its own way: the CUDA backend through
//! NCCL, the CPU backend through a [`CpuGroup`] of threads in one process, which is what lets
//! tests prove on any machine that a sharded model computes what the whole one does.

use crate::backend::{BackendError, Result};
use std::sync::{Arc, Condvar, Mutex};

/// Where one rank stands in its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankInfo {
    pub rank: usize,
    pub world: usize,
}

/// The rows of a table split over the vocabulary (the embedding, the LM head) that `rank` of
/// `world` holds: `vocab / world` each, one more on some, in rank order. Every rank derives every
/// other's part from this alone, which is what a gather of the logits needs.
pub fn vocab_part(vocab: usize, rank: usize, world: usize) -> std::ops::Range<usize> {
    let world = world.max(1);
    rank * vocab / world..(rank + 1) * vocab / world
}

/// This rank's part of a table of `vocab` rows split over its group ([`vocab_part`]), or an
/// error naming `what` when the matrix at hand holds `rows` rows instead.
pub fn own_vocab_part(
    what: &str,
    rows: usize,
    vocab: usize,
    info: RankInfo,
) -> Result<std::ops::Range<usize>> {
    let part = vocab_part(vocab, info.rank, info.world);
    match rows == part.len() {
        true => Ok(part),
        false => Err(BackendError::Unsupported(format!(
            "{what} of {rows} rows for rows {part:?} of a vocabulary of {vocab}"
        ))),
    }
}

/// An in-process group of `world` ranks (threads) that sum buffers in a fixed order.
///
/// Every rank deposits its buffer, then each computes `((b_0 + b_1) + b_2) + ...` for itself, so
/// all ranks get bit-identical sums and a run is deterministic. A rank that fails between
/// collectives [`abort`](CpuGroupMember::abort)s the group: the others' waits return an error
/// instead of blocking forever.
pub struct CpuGroup;

impl CpuGroup {
    /// The members of a new group, rank 0 first; hand one to each rank's backend.
    pub fn members(world: usize) -> Vec<CpuGroupMember> {
        let shared = Arc::new(Shared {
            world,
            state: Mutex::new(State {
                buffers: vec![Vec::new(); world],
                words: Vec::new(),
                arrived: 0,
                generation: 0,
                aborted: false,
            }),
            turn: Condvar::new(),
        });
        (0..world)
            .map(|rank| CpuGroupMember {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }
}

struct State {
    buffers: Vec<Vec<f32>>,
    /// What rank 0 broadcasts.
    words: Vec<u32>,
    arrived: usize,
    generation: u64,
    aborted: bool,
}

struct Shared {
    world: usize,
    state: Mutex<State>,
    turn: Condvar,
}

/// One rank's handle on a [`CpuGroup`].
pub struct CpuGroupMember {
    rank: usize,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for CpuGroupMember {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CpuGroupMember({}/{})", self.rank, self.shared.world)
    }
}

impl CpuGroupMember {
    pub fn info(&self) -> RankInfo {
        RankInfo {
            rank: self.rank,
            world: self.shared.world,
        }
    }

    /// Replaces `data` by the sum of every rank's `data` (same length on every rank), summed in
    /// rank order.
    pub fn all_reduce_sum(&self, data: &mut [f32]) -> Result<()> {
        if self.shared.world == 1 {
            return Ok(());
        }
        {
            let mut state = self.lock()?;
            let mine = &mut state.buffers[self.rank];
            mine.clear();
            mine.extend_from_slice(data);
        }
        self.barrier()?;
        {
            let state = self.lock()?;
            if let Some(b) = state.buffers.iter().find(|b| b.len() != data.len()) {
                let (n, m) = (b.len(), data.len());
                drop(state);
                self.abort();
                return Err(BackendError::Device(format!(
                    "all-reduce of {m} values met a rank with {n}"
                )));
            }
            data.copy_from_slice(&state.buffers[0]);
            for b in &state.buffers[1..] {
                for (d, v) in data.iter_mut().zip(b) {
                    *d += v;
                }
            }
        }
        // Nobody refills a buffer before every rank has read them all.
        self.barrier()
    }

    /// Replaces `data` on every rank by rank 0's (the tokens it sampled, which the other ranks
    /// need to embed the next step's carried ids).
    pub fn broadcast_from_first(&self, data: &mut Vec<u32>) -> Result<()> {
        if self.shared.world == 1 {
            return Ok(());
        }
        if self.rank == 0 {
            let mut state = self.lock()?;
            state.words.clear();
            state.words.extend_from_slice(data);
        }
        self.barrier()?;
        if self.rank != 0 {
            let state = self.lock()?;
            data.clear();
            data.extend_from_slice(&state.words);
        }
        // Rank 0 does not refill the words before every rank has read them.
        self.barrier()
    }

    /// Rank 0 gets every rank's `part` in rank order (`None` on the others): the pieces of the
    /// logits of a head split over the vocabulary.
    pub fn gather_to_first(&self, part: &[f32]) -> Result<Option<Vec<Vec<f32>>>> {
        if self.shared.world == 1 {
            return Ok(Some(vec![part.to_vec()]));
        }
        {
            let mut state = self.lock()?;
            let mine = &mut state.buffers[self.rank];
            mine.clear();
            mine.extend_from_slice(part);
        }
        self.barrier()?;
        let parts = match self.rank {
            0 => Some(self.lock()?.buffers.clone()),
            _ => None,
        };
        // Nobody refills a buffer before rank 0 has read them all.
        self.barrier()?;
        Ok(parts)
    }

    /// Wakes every rank waiting in (or later entering) a collective with an error: called by a
    /// rank that cannot reach the next collective.
    pub fn abort(&self) {
        if let Ok(mut state) = self.shared.state.lock() {
            state.aborted = true;
        }
        self.shared.turn.notify_all();
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, State>> {
        let state = self
            .shared
            .state
            .lock()
            .map_err(|_| BackendError::Device("a rank of the group panicked".into()))?;
        match state.aborted {
            true => Err(aborted()),
            false => Ok(state),
        }
    }

    fn barrier(&self) -> Result<()> {
        let mut state = self.lock()?;
        let generation = state.generation;
        state.arrived += 1;
        if state.arrived == self.shared.world {
            state.arrived = 0;
            state.generation += 1;
            self.shared.turn.notify_all();
            return Ok(());
        }
        while state.generation == generation && !state.aborted {
            state = self
                .shared
                .turn
                .wait(state)
                .map_err(|_| BackendError::Device("a rank of the group panicked".into()))?;
        }
        match state.aborted {
            true => Err(aborted()),
            false => Ok(()),
        }
    }
}

fn aborted() -> BackendError {
    BackendError::Device("another rank of the tensor-parallel group failed".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_group(world: usize, len: usize) -> Vec<Vec<f32>> {
        let members = CpuGroup::members(world);
        std::thread::scope(|s| {
            let handles: Vec<_> = members
                .into_iter()
                .map(|m| {
                    s.spawn(move || {
                        let r = m.info().rank;
                        let mut out = Vec::new();
                        for round in 0..3 {
                            let mut data: Vec<f32> = (0..len)
                                .map(|i| (i as f32 * 0.37 + r as f32 * 1.1 + round as f32).sin())
                                .collect();
                            m.all_reduce_sum(&mut data).unwrap();
                            out.extend(data);
                        }
                        out
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn every_rank_gets_the_rank_ordered_sum() {
        for world in [1, 2, 3, 4] {
            let got = run_group(world, 1000);
            for round in 0..3 {
                for i in 0..1000 {
                    let mut want = 0f32;
                    for r in 0..world {
                        let v = (i as f32 * 0.37 + r as f32 * 1.1 + round as f32).sin();
                        want = if r == 0 { v } else { want + v };
                    }
                    for rank in &got {
                        assert_eq!(rank[round * 1000 + i].to_bits(), want.to_bits());
                    }
                }
            }
        }
    }

    #[test]
    fn vocabulary_parts_tile_the_vocabulary() {
        for (vocab, world) in [(49152, 2), (128256, 4), (10, 3), (7, 8), (5, 1)] {
            let parts: Vec<_> = (0..world).map(|r| vocab_part(vocab, r, world)).collect();
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts[world - 1].end, vocab);
            for w in parts.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            for p in &parts {
                assert!(p.len() == vocab / world || p.len() == vocab / world + 1);
            }
        }
    }

    #[test]
    fn the_first_rank_gathers_every_part_in_rank_order() {
        let world = 3;
        let handles: Vec<_> = CpuGroup::members(world)
            .into_iter()
            .map(|m| {
                std::thread::spawn(move || {
                    let r = m.info().rank;
                    let part: Vec<f32> = (0..r + 1).map(|i| (10 * r + i) as f32).collect();
                    m.gather_to_first(&part).unwrap()
                })
            })
            .collect();
        let got: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let want = vec![vec![0.0], vec![10.0, 11.0], vec![20.0, 21.0, 22.0]];
        assert_eq!(got[0].as_ref(), Some(&want));
        assert!(got[1].is_none() && got[2].is_none());
    }

    #[test]
    fn every_rank_gets_the_first_ranks_words() {
        let members = CpuGroup::members(3);
        let got: Vec<Vec<u32>> = std::thread::scope(|s| {
            let handles: Vec<_> = members
                .into_iter()
                .map(|m| {
                    s.spawn(move || {
                        let r = m.info().rank as u32;
                        let mut seen = Vec::new();
                        for round in 0..4u32 {
                            // Peers' own values (and lengths) are replaced by rank 0's.
                            let mut data: Vec<u32> = (0..round + r).map(|i| 100 * r + i).collect();
                            m.broadcast_from_first(&mut data).unwrap();
                            seen.push(data.len() as u32);
                            seen.extend(data);
                        }
                        seen
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want: Vec<u32> = (0..4u32)
            .flat_map(|round| std::iter::once(round).chain(0..round))
            .collect();
        for rank in &got {
            assert_eq!(rank, &want);
        }
    }

    #[test]
    fn an_aborting_rank_releases_the_others() {
        let members = CpuGroup::members(3);
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = members
                .into_iter()
                .map(|m| {
                    s.spawn(move || {
                        if m.info().rank == 1 {
                            m.abort();
                            return Err(aborted());
                        }
                        let mut data = vec![1.0; 8];
                        m.all_reduce_sum(&mut data)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(results.iter().all(|r| r.is_err()));
    }

    #[test]
    fn mismatched_lengths_are_an_error_not_a_hang() {
        let members = CpuGroup::members(2);
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = members
                .into_iter()
                .map(|m| {
                    s.spawn(move || {
                        let mut data = vec![1.0; 4 + m.info().rank];
                        m.all_reduce_sum(&mut data)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(results.iter().all(|r| r.is_err()));
    }
}
