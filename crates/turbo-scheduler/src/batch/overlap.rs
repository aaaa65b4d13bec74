//! Overlapped stepping (the overlap scheduler of SGLang, vLLM's asynchronous scheduling): the
//! host issues step n+1 before it takes step n's sampled tokens back, and processes those tokens
//! (streaming, stop checks, ends) while the device runs step n+1. The device then never waits
//! for the host's scheduling, batch preparation and output processing between steps.
//!
//! A decoding sequence's input in step n+1 is the token step n samples, which the host does not
//! know when it issues step n+1: its row names that token by step n's output row
//! ([`CARRIED_TOKEN`]) and the backend takes it where step n left it. Everything else a row
//! needs (its position, KV slot and block table) does not depend on the token. The KV a step
//! writes counts as computed once the step is issued (later steps run after it on the device),
//! except a carried row's, which counts once its token is known, so that every block the KV
//! manager hashes holds known tokens.
//!
//! What it costs: a request that ends at step n on an end-of-sequence token or a stop string
//! already has a row in step n+1, whose token is dropped (a length limit is known ahead, so
//! those requests get no extra row); tokens reach their streams one step later. A step runs
//! alone (the step in flight is read back first, and it is read back before the next one is
//! prepared) when it holds a row of a request that needs each token on the host first:
//! penalties (they count every earlier token), log-probabilities (the logits come back), teacher
//! forcing, and KV eviction while a prompt is coming in and at the decode step after which the
//! sequence compacts (its other decode steps only add to its scores on the device, in stream
//! order, and overlap; their Keyformer temperature counts the tokens in flight). On a model
//! split over ranks, rank 0 samples and its peers take its tokens on their devices, so they
//! resolve the carried ids as rank 0 does. The step in flight is read back before scheduling
//! when the next step might have to preempt (fewer free blocks than every running sequence's
//! next tokens could take), because a preempted request would lose its token in flight.

use super::profile::StepClock;
use super::{BatchError, PersistentBatch, RequestError, RequestId, StepReport, Work};
use std::time::Instant;
use turbo_core::backend::{TokensLater, CARRIED_TOKEN};
use turbo_core::sampling::NO_FINITE_LOGIT;
use turbo_core::Backend;
use turbo_kv::KvError;

/// A step issued and not yet read back. Dropped unread (the batch dropped mid-step), it still
/// waits for the step, whose device work writes into the buffers the tokens come back in.
pub(super) struct InFlight {
    rows: Vec<IssuedRow>,
    tokens: Option<TokensLater>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(tokens) = self.tokens.take() {
            let _ = tokens.wait();
        }
    }
}

/// One row of a step in flight: its work, whose it is (the slot may hold another request when
/// the tokens come back), and whether its token is one its request takes.
struct IssuedRow {
    work: Work,
    id: RequestId,
    samples: bool,
}

impl<B: Backend> PersistentBatch<B> {
    /// Overlaps each step with the previous one (`on`; by default on where the backend runs
    /// steps ahead of the host, a GPU), or runs them one at a time. Steps that cannot overlap
    /// (see the module docs) run one at a time either way.
    pub fn set_overlap(&mut self, on: bool) {
        self.overlap = on;
    }

    /// Whether steps overlap where they can.
    pub fn overlaps(&self) -> bool {
        self.overlap
    }

    /// Whether the row `w` needs its request's tokens on the host before it is prepared, so
    /// that a step holding it runs alone: its penalties count every earlier token, its
    /// log-probabilities come from logits read back, its teacher forcing replaces the sampled
    /// token. A request that evicts KV runs alone while its prompt is coming (it may compact
    /// between chunks and once the prompt is in) and for the decode step after which it
    /// compacts, which happens between steps; its other decode steps only add to its scores on
    /// the device and overlap like any.
    pub(super) fn needs_tokens_now(&self, w: &Work) -> Result<bool, KvError> {
        let Some(l) = self.slots[w.slot].as_ref() else {
            return Ok(false);
        };
        if l.logprobs.is_some() || l.generated.len() < l.forced.len() || l.sampler.has_penalties() {
            return Ok(true);
        }
        let Some(e) = &l.eviction else {
            return Ok(false);
        };
        let decoding = w.carried.is_some()
            || (w.len == 1
                && !l.generated.is_empty()
                && w.start + 1 >= self.kv.tokens(l.seq)?.len());
        // The keys it holds once this row's KV is in, as the step's postprocessing counts them.
        let keys = (w.start + w.len).saturating_sub(self.kv.evicted(l.seq)?);
        Ok(!decoding || e.due(keys, false, false, self.config.block_size))
    }

    /// Whether scheduling the next step might preempt a running request: the blocks every
    /// running sequence's next tokens could take exceed the free and evictable ones. Only then
    /// does the step in flight have to be read back first.
    pub(super) fn must_drain(&self) -> Result<bool, KvError> {
        let mut needed = 0;
        for slot in 0..self.slots.len() {
            let Some(live) = &self.slots[slot] else {
                continue;
            };
            let want = self.pending(slot)?.min(self.config.prefill_chunk);
            let upto = self.kv.computed(live.seq)? + want;
            needed += self.kv.blocks_to_reserve(live.seq, upto)?;
        }
        Ok(needed > self.kv.num_free() + self.kv.num_evictable())
    }

    /// Issues `work` without waiting for it, then reads back and processes the step that was in
    /// flight before it.
    pub(super) fn issue(
        &mut self,
        work: &[Work],
        report: &mut StepReport,
        clock: &mut StepClock,
    ) -> Result<(), BatchError> {
        let issued = self.inputs(work).and_then(|inputs| {
            Ok(self.model.forward_sample_later(
                &inputs.chunks,
                &mut self.cache,
                &inputs.params,
                &inputs.penalties,
            )?)
        });
        let tokens = match issued {
            Ok(tokens) => tokens,
            Err(e) => {
                self.fail_all(work, &e)?;
                if let Some(previous) = self.in_flight.take() {
                    // Its requests still get their tokens, or its error.
                    let _ = self.finish_in_flight(previous, report, clock);
                }
                return Err(e);
            }
        };
        clock.launched();
        report.sequences = work.len();
        report.tokens = work.iter().map(|w| w.len).sum();
        let mut rows = Vec::with_capacity(work.len());
        for (row, w) in work.iter().enumerate() {
            let live = self.slots[w.slot].as_mut().expect("scheduled slots run");
            let seq = live.seq;
            if w.carried.is_some() || (w.len == 1 && !live.generated.is_empty()) {
                report.decode_sequences += 1;
            } else {
                report.prefill_tokens += w.len;
            }
            let samples = match w.carried {
                Some(_) => {
                    live.commit_when_known = Some(w.start + 1);
                    true
                }
                None => {
                    self.kv.commit(seq, w.start + w.len)?;
                    w.start + w.len >= self.kv.tokens(seq)?.len()
                }
            };
            let live = self.slots[w.slot].as_mut().expect("scheduled slots run");
            if samples {
                live.in_flight += 1;
                live.out_row = row as u32;
            }
            let blocks = self.kv.block_table(seq)?.len();
            live.kv_blocks_peak = live.kv_blocks_peak.max(blocks);
            live.kv_held = (self.kv.keys(seq)?, blocks);
            rows.push(IssuedRow {
                work: *w,
                id: live.id,
                samples,
            });
        }
        self.tokens_run += report.tokens as u64;
        self.steps += 1;
        let issued = InFlight {
            rows,
            tokens: Some(tokens),
        };
        if let Some(previous) = self.in_flight.replace(issued) {
            self.overlapped_steps += 1;
            self.finish_in_flight(previous, report, clock)?;
        }
        Ok(())
    }

    /// Reads back the tokens of a step in flight and gives each to its request, if that request
    /// is still running: it is appended to the sequence (making the KV of the row that carried it
    /// in the next step count as computed), streamed, and checked for the request's end.
    pub(super) fn finish_in_flight(
        &mut self,
        mut f: InFlight,
        report: &mut StepReport,
        clock: &mut StepClock,
    ) -> Result<(), BatchError> {
        let tokens = f.tokens.take().expect("a step in flight is read back once");
        let sampled = match tokens.wait() {
            Ok(sampled) => sampled,
            Err(e) => {
                let error = BatchError::Model(e.into());
                for r in &f.rows {
                    if self.holds(r.work.slot, r.id) {
                        self.fail(r.work.slot, RequestError::Model(error.to_string()))?;
                        report.ended += 1;
                    }
                }
                return Err(error);
            }
        };
        clock.waited(sampled.device_micros);
        for (row, r) in f.rows.iter().enumerate() {
            if !r.samples || !self.holds(r.work.slot, r.id) {
                continue;
            }
            let slot = r.work.slot;
            let live = self.slots[slot].as_mut().expect("held above");
            let seq = live.seq;
            let token = *sampled.tokens.get(row).ok_or_else(|| {
                BatchError::Config(format!(
                    "a step of {} rows read back {} tokens",
                    f.rows.len(),
                    sampled.tokens.len()
                ))
            })?;
            live.in_flight -= 1;
            live.first_token.get_or_insert_with(Instant::now);
            if token == NO_FINITE_LOGIT {
                // The step issued after this one carried it (as a row of NaN): its row is
                // skipped when read back, as the request no longer holds the slot.
                self.fail_without_finite_logits(slot)?;
                report.ended += 1;
                continue;
            }
            debug_assert_eq!(token & CARRIED_TOKEN, 0);
            let commit = live.commit_when_known.take();
            self.kv.append_token(seq, token)?;
            if let Some(upto) = commit {
                self.kv.commit(seq, upto)?;
            }
            let held = (self.kv.keys(seq)?, self.kv.block_table(seq)?.len());
            let live = self.slots[slot].as_mut().expect("held above");
            live.kv_held = held;
            match super::stream_token(live, &self.tokenizer, token) {
                Ok(None) => continue,
                Ok(Some(reason)) => self.end(slot, reason)?,
                Err(e) => self.fail(slot, RequestError::Detokenize(e.to_string()))?,
            }
            report.ended += 1;
        }
        clock.postprocessed();
        Ok(())
    }

    /// Whether `slot` still holds request `id`.
    fn holds(&self, slot: usize, id: RequestId) -> bool {
        self.slots[slot].as_ref().is_some_and(|l| l.id == id)
    }

    /// [`Self::drain`]; on a failure, the requests whose state it left uncertain fail too.
    pub(super) fn drain_or_abandon(
        &mut self,
        report: &mut StepReport,
        clock: &mut StepClock,
    ) -> Result<(), BatchError> {
        match self.drain(report, clock) {
            Ok(()) => Ok(()),
            Err(e) => {
                report.ended += self.abandon_in_flight(&e)?;
                Err(e)
            }
        }
    }

    /// After a failure while steps were in flight: fails every request with a row in the step
    /// still in flight (its KV counts as computed but the device reported an error) and every
    /// request still waiting for a token, since their bookkeeping may be part-way; the others go
    /// on. Returns how many requests it ended.
    pub(super) fn abandon_in_flight(&mut self, error: &BatchError) -> Result<usize, KvError> {
        let mut ended = 0;
        let message = error.to_string();
        if let Some(f) = self.in_flight.take() {
            for r in &f.rows {
                if self.holds(r.work.slot, r.id) {
                    self.fail(r.work.slot, RequestError::Model(message.clone()))?;
                    ended += 1;
                }
            }
        }
        for slot in 0..self.slots.len() {
            let uncertain = self.slots[slot]
                .as_ref()
                .is_some_and(|l| l.in_flight > 0 || l.commit_when_known.is_some());
            if uncertain {
                self.fail(slot, RequestError::Model(message.clone()))?;
                ended += 1;
            }
        }
        Ok(ended)
    }

    /// Reads back the step in flight, if any (before a step that cannot overlap, or when
    /// nothing is left to issue).
    pub(super) fn drain(
        &mut self,
        report: &mut StepReport,
        clock: &mut StepClock,
    ) -> Result<(), BatchError> {
        match self.in_flight.take() {
            Some(f) => self.finish_in_flight(f, report, clock),
            None => Ok(()),
        }
    }
}
