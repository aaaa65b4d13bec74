//! Generation for one sequence at a time, over sessions that keep their KV between requests.

use crate::completion::{Completion, FinishReason, Timings};
use crate::sampling::{Sampler, SamplingParams};
use crate::stop::StopStrings;
use std::time::Instant;
use thiserror::Error;
use turbo_core::sampling::{PenaltyLists, SampleParams};
use turbo_core::Backend;
use turbo_kv::{BlockPool, BlockTable, KvError};
use turbo_llama::{Llama, LlamaError, SequenceChunk};
use turbo_tokenizer::tokenizer::{TextStream, TextTokenizer};

#[derive(Debug, Error)]
pub enum EngineError {
    #[error("the prompt has {prompt} tokens, but the model's context holds {context}")]
    PromptTooLong { prompt: usize, context: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    BadToken { id: u32, vocab: usize },
    #[error("invalid sampling parameters: {0}")]
    Sampling(String),
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error(transparent)]
    Model(#[from] LlamaError),
}

impl From<turbo_tokenizer::tokenizer::TokenizerError> for EngineError {
    fn from(e: turbo_tokenizer::tokenizer::TokenizerError) -> Self {
        EngineError::Model(e.into())
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;

/// What to generate after a prompt.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop_strings: Vec<String>,
    /// Keep going past end-of-sequence tokens (for benchmarks).
    pub ignore_eos: bool,
}

impl Default for GenerationRequest {
    fn default() -> Self {
        GenerationRequest {
            sampling: SamplingParams::default(),
            max_tokens: 256,
            stop_strings: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// A conversation's tokens and the KV blocks that hold them, kept between requests so a new turn
/// prefills only what is new.
#[derive(Debug, Default)]
pub struct Session {
    /// Every token of the sequence so far (prompts and generated tokens).
    tokens: Vec<u32>,
    /// Leading tokens whose KV is in the cache.
    cached: usize,
    table: BlockTable,
}

impl Session {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn cached_len(&self) -> usize {
        self.cached
    }
}

/// A model, its KV cache and block pool, generating for one session at a time.
pub struct Engine<B: Backend> {
    model: Llama<B>,
    tokenizer: TextTokenizer,
    cache: B::KvCache,
    pool: BlockPool,
    /// Longest run of prompt tokens per forward pass, bounding activation memory.
    prefill_chunk: usize,
}

impl<B: Backend> Engine<B> {
    /// An engine whose KV cache holds `kv_blocks` blocks of `block_size` tokens.
    pub fn new(
        model: Llama<B>,
        tokenizer: TextTokenizer,
        block_size: usize,
        kv_blocks: usize,
    ) -> Result<Self> {
        let cache = model
            .backend()
            .kv_cache(model.kv_spec(block_size, kv_blocks))
            .map_err(LlamaError::from)?;
        Ok(Engine {
            model,
            tokenizer,
            cache,
            pool: BlockPool::new(kv_blocks as u32, block_size),
            prefill_chunk: 512,
        })
    }

    /// An engine with room for one full-context sequence.
    pub fn for_context(
        model: Llama<B>,
        tokenizer: TextTokenizer,
        block_size: usize,
    ) -> Result<Self> {
        let blocks = model.config.context_length.div_ceil(block_size);
        Self::new(model, tokenizer, block_size, blocks)
    }

    pub fn model(&self) -> &Llama<B> {
        &self.model
    }

    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    pub fn set_prefill_chunk(&mut self, tokens: usize) {
        self.prefill_chunk = tokens.max(1);
    }

    /// Frees a session's KV blocks.
    pub fn release(&mut self, session: &mut Session) -> Result<()> {
        session.table.release(&mut self.pool)?;
        session.tokens.clear();
        session.cached = 0;
        Ok(())
    }

    /// Runs the session's tokens after the first `session.cached` up to `upto`, returning the
    /// token `sampler` chooses from the last one's logits.
    fn extend(&mut self, session: &mut Session, upto: usize, sampler: &mut Sampler) -> Result<u32> {
        let mut token = 0;
        while session.cached < upto {
            let end = upto.min(session.cached + self.prefill_chunk);
            session.table.reserve(&mut self.pool, end)?;
            let chunk = SequenceChunk {
                tokens: session.tokens[session.cached..end].to_vec(),
                start: session.cached,
                block_table: session.table.blocks().to_vec(),
            };
            // Only the last chunk's token is used; the others are chosen greedily, without a draw.
            let (params, penalized) = if end == upto {
                let params = sampler.next_params();
                (params, sampler.penalized(&session.tokens[..upto]))
            } else {
                (SampleParams::GREEDY, &[][..])
            };
            let penalties = PenaltyLists::from_rows([penalized]);
            token = self
                .model
                .forward_sample(&[chunk], &mut self.cache, &[params], &penalties)?[0];
            session.cached = end;
            session.table.set_len(end, self.pool.block_size());
        }
        Ok(token)
    }

    /// Generates a continuation of `prompt`, the sequence's full token list (for a chat: the
    /// whole conversation rendered so far). Tokens it shares with what the session already holds
    /// reuse their KV; only the rest is prefilled. `on_text` receives text as it is decoded and
    /// returns `false` to cancel.
    pub fn generate(
        &mut self,
        session: &mut Session,
        prompt: &[u32],
        request: &GenerationRequest,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<Completion> {
        let context = self.model.config.context_length;
        let vocab = self.model.config.vocab_size;
        request.sampling.validate().map_err(EngineError::Sampling)?;
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt.len() >= context {
            return Err(EngineError::PromptTooLong {
                prompt: prompt.len(),
                context,
            });
        }
        if let Some(&id) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::BadToken { id, vocab });
        }
        let started = Instant::now();

        // Keep the KV of the longest common prefix; at least the last prompt token is run so that
        // its logits exist.
        let common = session
            .tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(session.cached)
            .min(prompt.len() - 1);
        session.table.truncate(&mut self.pool, common)?;
        session.cached = common;
        session.tokens.truncate(common);
        session.tokens.extend_from_slice(&prompt[common..]);
        let mut sampler = Sampler::new(request.sampling.clone());
        let mut token = self.extend(session, prompt.len(), &mut sampler)?;
        let prefill_ms = started.elapsed().as_secs_f64() * 1e3;
        let decode_started = Instant::now();

        let mut stream = TextStream::new();
        let mut stops = StopStrings::new(request.stop_strings.clone());
        let mut text = String::new();
        let mut generated = Vec::new();
        let max_tokens = request.max_tokens.min(context - prompt.len());
        let mut finish = FinishReason::Length;
        let mut hit_stop_string = false;
        while generated.len() < max_tokens {
            generated.push(token);
            session.tokens.push(token);
            if !request.ignore_eos && self.tokenizer.is_eos(token) {
                finish = FinishReason::Stop;
                break;
            }
            let delta = stream.push(&self.tokenizer, token)?;
            let (released, hit) = stops.push(&delta);
            text.push_str(&released);
            if !released.is_empty() && !on_text(&released) {
                finish = FinishReason::Cancelled;
                break;
            }
            if hit {
                finish = FinishReason::Stop;
                hit_stop_string = true;
                break;
            }
            if generated.len() < max_tokens {
                let upto = session.tokens.len();
                token = self.extend(session, upto, &mut sampler)?;
            }
        }
        // Text held back as a possible stop string (or an incomplete character) is released unless
        // a stop string was actually hit.
        if !hit_stop_string {
            let (tail, _) = stops.push(&stream.finish(&self.tokenizer)?);
            let tail = tail + &stops.finish();
            if !tail.is_empty() && finish != FinishReason::Cancelled {
                on_text(&tail);
                text.push_str(&tail);
            }
        }
        Ok(Completion {
            token_ids: generated,
            text,
            finish_reason: finish,
            cached_prompt_tokens: common,
            prefilled_tokens: prompt.len() - common,
            preemptions: 0,
            timings: Timings {
                queue_ms: 0.0,
                prefill_ms,
                decode_ms: decode_started.elapsed().as_secs_f64() * 1e3,
            },
        })
    }
}
