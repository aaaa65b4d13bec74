//! Where a step's time goes: the host's scheduling, the forward pass's host part, the wait for
//! its results, the device's own time, and the host's work on the results. A batch always keeps
//! the sums ([`StepPhases`], in [`super::BatchStats`]); with a profile on it also keeps one
//! [`StepTiming`] per step, for timelines.

use std::time::Instant;
use turbo_llama::ForwardTimes;

/// Most steps a profile keeps (about 80 MB); later steps are counted in the sums only.
pub const MAX_PROFILED_STEPS: usize = 1 << 20;

/// One step of a profile.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTiming {
    /// Microseconds since the profile started, at the step's start.
    pub at_micros: f64,
    /// Sequences and tokens in the forward pass, and of those tokens the prefill ones.
    pub sequences: usize,
    pub tokens: usize,
    pub prefill_tokens: usize,
    /// Choosing the step's work and reserving its KV blocks.
    pub schedule_micros: f64,
    /// The forward pass's host part: gathering the chunks, preparing and uploading the batch,
    /// issuing (or replaying) its device work.
    pub forward_micros: f64,
    /// Waiting for the sampled tokens (or logits) to come back.
    pub wait_micros: f64,
    /// The device's time for the step, when the backend measures it. Under overlapped stepping
    /// a call issues one step and reads back the one before it, so this is the device time of
    /// the step read back during the call (the previous one), and `wait_micros` the wait for it.
    pub device_micros: Option<f64>,
    /// Committing KV, streaming tokens and text, stop checks, ends, KV compaction.
    pub postprocess_micros: f64,
}

impl StepTiming {
    /// The step's wall time on the host.
    pub fn total_micros(&self) -> f64 {
        self.schedule_micros + self.forward_micros + self.wait_micros + self.postprocess_micros
    }
}

/// Sums of the phases of every step since the batch was made, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepPhases {
    pub schedule_micros: u64,
    pub forward_micros: u64,
    pub wait_micros: u64,
    /// Summed over the steps whose device time was measured.
    pub device_micros: u64,
    pub postprocess_micros: u64,
}

impl StepPhases {
    fn add(&mut self, t: &StepTiming) {
        self.schedule_micros += t.schedule_micros as u64;
        self.forward_micros += t.forward_micros as u64;
        self.wait_micros += t.wait_micros as u64;
        self.device_micros += t.device_micros.unwrap_or(0.0) as u64;
        self.postprocess_micros += t.postprocess_micros as u64;
    }
}

/// The clock of one step: marks the end of each phase.
pub(super) struct StepClock {
    started: Instant,
    last: Instant,
    timing: StepTiming,
}

impl StepClock {
    pub(super) fn start() -> Self {
        let now = Instant::now();
        StepClock {
            started: now,
            last: now,
            timing: StepTiming::default(),
        }
    }

    /// Microseconds since the last mark (or the start).
    fn lap(&mut self) -> f64 {
        let now = Instant::now();
        let micros = (now - self.last).as_secs_f64() * 1e6;
        self.last = now;
        micros
    }

    /// Marks the end of scheduling (phases add up: a step may read back the step in flight
    /// before scheduling, and again after issuing).
    pub(super) fn scheduled(&mut self) {
        self.timing.schedule_micros += self.lap();
    }

    /// The forward pass ended and its tokens are back; `times` splits it into its host part
    /// and its wait.
    pub(super) fn forwarded(&mut self, times: ForwardTimes) {
        let all = self.lap();
        let wait = times.wait_micros.min(all);
        self.timing.wait_micros += wait;
        self.timing.forward_micros += all - wait;
        self.timing.device_micros = times.device_micros;
    }

    /// A forward pass was issued without waiting for it.
    pub(super) fn launched(&mut self) {
        self.timing.forward_micros += self.lap();
    }

    /// An earlier step's tokens came back; `device_micros` is that step's device time.
    pub(super) fn waited(&mut self, device_micros: Option<f64>) {
        self.timing.wait_micros += self.lap();
        if device_micros.is_some() {
            self.timing.device_micros = device_micros;
        }
    }

    pub(super) fn postprocessed(&mut self) {
        self.timing.postprocess_micros += self.lap();
    }

    pub(super) fn started(&self) -> Instant {
        self.started
    }
}

/// The sums, and the per-step timeline while a profile is on.
#[derive(Default)]
pub(super) struct StepProfile {
    pub(super) phases: StepPhases,
    /// When the profile started; `None` while it is off.
    origin: Option<Instant>,
    steps: Vec<StepTiming>,
}

impl StepProfile {
    pub(super) fn set_on(&mut self, on: bool) {
        self.origin = match (on, self.origin) {
            (true, Some(o)) => Some(o),
            (true, None) => Some(Instant::now()),
            (false, _) => None,
        };
    }

    /// Adds a step that ran `sequences` sequences of `tokens` tokens, `prefill_tokens` of them
    /// prefill.
    pub(super) fn record(
        &mut self,
        clock: StepClock,
        sequences: usize,
        tokens: usize,
        prefill_tokens: usize,
    ) {
        let mut t = clock.timing;
        t.sequences = sequences;
        t.tokens = tokens;
        t.prefill_tokens = prefill_tokens;
        self.phases.add(&t);
        if let Some(origin) = self.origin {
            if self.steps.len() < MAX_PROFILED_STEPS {
                t.at_micros = clock
                    .started
                    .saturating_duration_since(origin)
                    .as_secs_f64()
                    * 1e6;
                self.steps.push(t);
            }
        }
    }

    pub(super) fn take(&mut self) -> Vec<StepTiming> {
        std::mem::take(&mut self.steps)
    }

    /// Forgets every step so far (the sums and the timeline), keeping the profile on or off.
    pub(super) fn reset(&mut self) {
        self.phases = StepPhases::default();
        self.steps.clear();
        if self.origin.is_some() {
            self.origin = Some(Instant::now());
        }
    }
}
