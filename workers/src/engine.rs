//! Continuous batching, as vLLM's scheduler does it, in simulated time.
//!
//! [`Engine::start`] spawns one scheduler task on the current tokio runtime;
//! [`Engine`] is a cheap-to-clone handle to it. The model follows vLLM V1's
//! scheduler (`vllm/v1/core/sched/scheduler.py`): *continuous batching*
//! (Orca, OSDI '22; vLLM, SOSP '23), where requests join and leave the
//! running batch at every step instead of waiting for a whole batch to end,
//! on top of the block KV cache with automatic prefix caching of
//! [`crate::prefix_cache`].
//!
//! # Requests
//!
//! [`Engine::submit`] validates a request ([`SubmitError`]), computes the
//! chained block hashes of its prompt + output once, appends it to the FIFO
//! waiting queue, wakes the scheduler and returns its [`EngineStream`].
//!
//! # Steps
//!
//! The scheduler runs steps while a request is waiting or running, and
//! sleeps on a [`tokio::sync::Notify`] otherwise. One step:
//!
//! 1. **Aborts.** Requests whose [`EngineStream`] was dropped (the client
//!    left) leave the queue or the batch; their blocks are released,
//!    registering only what was computed (`requests_aborted`).
//! 2. **Admission.** While the batch has fewer than `max_num_seqs`
//!    sequences and the prefix cache can allocate the blocks of the request
//!    at the head of the queue (its cached prefix + blocks for the rest of
//!    the prompt and the *whole* output), the head joins the batch. The
//!    queue is strict FIFO (vLLM's default first-come-first-served policy):
//!    if the head does not fit, nobody behind it is admitted. So, at a step
//!    boundary, `waiting > 0` exactly when the batch is full, by sequences
//!    or by KV blocks; a request submitted during a step waits for the next
//!    boundary, as in vLLM. Admission adds the prompt length to
//!    `prefix_cache_queries` and the cached tokens to `prefix_cache_hits`
//!    (vLLM counts both in tokens).
//! 3. **Duration.** `prefill_time(uncached prompt tokens of the requests
//!    admitted in this step)`, plus `decode_step_time(n)` if `n > 0`
//!    requests are in their decode phase (see [`EngineConfig`]).
//! 4. **Sleep** for that duration times `time_scale`.
//! 5. **Output.** Each request admitted in this step emits
//!    [`Event::FirstToken`] (its cached tokens and its TTFT: queueing +
//!    prefill) and enters its decode phase; each request already decoding
//!    emits its next [`Event::Token`]. A request that has emitted all its
//!    output tokens emits [`Event::Finished`], leaves the batch and releases
//!    its blocks, registering the full blocks of prompt + generated tokens so
//!    that the next turn of the conversation hits them. A request with one
//!    output token finishes right after its prefill.
//!
//! # Disaggregated serving
//!
//! [`Engine::submit_with`] takes a [`KvHandoff`] for the two legs of
//! prefill/decode disaggregation (the protocols are in [`crate::pd`]). A
//! prefill leg's prompt blocks stay pinned when it finishes
//! ([`KvHandoff::hold_prompt`], vLLM's delayed free for a remote reader)
//! until [`Engine::release_pin`]; pinned blocks count as used KV and are
//! never evicted, and an idle engine whose queue head does not fit beside
//! them waits for a release. A decode leg whose prompt KV was pulled
//! ([`KvHandoff::pulled_from`]) counts the pulled tokens as computed at
//! admission (its full blocks are registered in the prefix cache then, as
//! any prompt's), so its prefill costs only what it lacks and the last
//! prompt token; its `cached_tokens` include the pulled tokens, as vLLM's
//! `num_cached_tokens` does for KV loaded by a connector.
//!
//! Interference, the reason for disaggregation, is in the step duration
//! above: a step that admits prompts lasts their prefill time *plus* the
//! decode step, so every request decoding in the same batch waits for
//! the newcomers' prefill. A prefill-only engine's one-token requests
//! finish at the end of their prefill step; a decode engine fed pulled
//! prompts pays (almost) no prefill, so its steps stay short.
//!
//! # Time
//!
//! Durations are simulated; the scheduler sleeps `simulated × time_scale`
//! of real time with tokio's clock (so tests can pause it). Steps are chained
//! on a virtual clock: a step starts where the previous one ended (or when
//! the newest request it admits arrived, if later) and the scheduler sleeps
//! *until* its computed end. tokio's timers have a resolution of 1 ms, so a
//! decode step of 80 µs (8 ms at `time_scale` 0.01) cannot be slept alone;
//! with the chaining, the steps that fall due within one timer tick run
//! back to back, the error does not accumulate, and TTFT and end-to-end
//! latency, which are measured on the virtual clock (submission to the end
//! of the step), are exact. If the process falls behind by more than
//! 20 ms of real time (overload), the clock restarts from now instead of
//! bursting to catch up.
//!
//! # Shutdown
//!
//! When every [`Engine`] handle is dropped, the scheduler stops accepting
//! work (no handle can submit), runs the requests it has to the end (their
//! streams stay live; dropping a stream aborts its request as usual), and
//! its task ends.
//!
//! # Simplifications (against vLLM)
//!
//! * No chunked prefill and no per-step token budget
//!   (`max_num_batched_tokens`): a step prefills all the prompts it admits,
//!   and the step's duration is the prefill time plus the decode time (vLLM
//!   runs both in one mixed forward pass, whose cost is roughly the sum of
//!   the compute-bound prefill and the memory-bound decode).
//! * KV blocks for the whole output are reserved at admission, so there is
//!   no preemption (see [`crate::prefix_cache`]).
//! * Aborts take effect at step boundaries.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::config::EngineConfig;
use crate::histogram::{E2E_BUCKETS, Histogram, TTFT_BUCKETS};
use crate::kv_events::{KvEvent, WireHash};
use crate::prefix_cache::{Allocation, BlockHash, CacheEvent, PrefixCache, blocks_for, chained_hashes};

/// How far (real time) the scheduler may lag behind its virtual clock before
/// the clock restarts from now.
const MAX_LAG: Duration = Duration::from_millis(20);

/// One request as the engine sees it: prompt token ids and the output token
/// ids it will "generate" (drawn by the caller, see [`crate::output_vocab::OutputVocab`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Output token ids, in order; at least one.
    pub output: Vec<u32>,
    /// Its prefix-cache root: 0, or its LoRA adapter's
    /// ([`EngineConfig::cache_root`]).
    pub root: u64,
    /// What its KV cache events say of its blocks beyond their tokens.
    pub keys: BlockKeys,
}

/// What a request's blocks carry besides their tokens, as its KV cache
/// events name it ([`crate::kv_events::KvEvent::Stored`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockKeys {
    /// Its LoRA adapter, if it names one.
    pub lora_name: Option<String>,
    /// Its `cache_salt`, if it has one.
    pub salt: Option<String>,
}

/// What a leg of disaggregated serving asks of the engine beyond a plain
/// request ([`Engine::submit_with`]; `Default`: nothing, a plain request).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvHandoff {
    /// A prefill leg: when the request finishes, its prompt's blocks stay
    /// pinned under this key (never evicted) for a decode engine to read,
    /// until [`Engine::release_pin`]; [`Engine::pinned`] names them.
    pub hold_prompt: Option<u64>,
    /// A decode leg: the prompt's KV from this token on was pulled from a
    /// prefill engine. At admission the pulled tokens count as computed,
    /// as the prefix cache's hits do: only the tokens before this one that
    /// the cache lacks, and the last prompt token (whose logits sample the
    /// first output token, as vLLM recomputes it), cost prefill time.
    pub pulled_from: Option<usize>,
    /// Simulated time the request spent before it was submitted (waiting
    /// for its KV, transferring it), counted in its TTFT and end-to-end
    /// latency.
    pub waited: Duration,
}

/// A prompt's blocks held for a remote decode ([`KvHandoff::hold_prompt`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinnedPrompt {
    /// The physical ids of the blocks the prompt occupies, in order (the
    /// last one partial when the prompt does not fill it).
    pub block_ids: Vec<usize>,
    /// Prompt tokens.
    pub num_tokens: usize,
    /// The chained hashes of the prompt's full blocks.
    pub block_hashes: Vec<BlockHash>,
}

/// Token counts of a finished request (OpenAI `usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
}

/// What the engine reports for one request, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Prefill is done and the first output token is out.
    FirstToken {
        /// The token.
        id: u32,
        /// Prompt tokens that came from the prefix cache.
        cached_tokens: u32,
        /// Simulated seconds from submission to this token (queueing + prefill).
        ttft_s: f64,
    },
    /// The next output token.
    Token {
        /// The token.
        id: u32,
    },
    /// The last token was sent.
    Finished {
        /// Token counts.
        usage: Usage,
    },
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The prompt is empty.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// No output tokens were asked for.
    #[error("at least one output token is needed")]
    NoOutput,
    /// Prompt + output exceed the model's context.
    #[error(
        "prompt ({prompt} tokens) plus output ({output} tokens) exceed the model's maximum context length of {max} tokens"
    )]
    TooLong {
        /// Prompt tokens.
        prompt: u32,
        /// Output tokens.
        output: u32,
        /// `max_model_len`.
        max: u32,
    },
    /// The request alone needs more KV blocks than the whole cache has.
    #[error("the request needs {needed} KV blocks but the cache has {capacity}")]
    ExceedsKvCapacity {
        /// Blocks needed.
        needed: u64,
        /// Blocks in the cache.
        capacity: u64,
    },
}

/// A snapshot of the engine's state and counters (what `/metrics` shows).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineStats {
    /// Requests in the FIFO queue (not yet in the batch).
    pub waiting: usize,
    /// Requests in the running batch.
    pub running: usize,
    /// Fraction of KV blocks held by running requests (0..=1).
    pub kv_usage: f64,
    /// KV blocks in the cache.
    pub num_blocks: u64,
    /// Prompt tokens looked up in the prefix cache (counter).
    pub prefix_cache_queries: u64,
    /// Of those, tokens found (counter).
    pub prefix_cache_hits: u64,
    /// Prompt tokens processed (counter).
    pub prompt_tokens: u64,
    /// Tokens generated (counter).
    pub generation_tokens: u64,
    /// Requests finished (counter).
    pub requests_finished: u64,
    /// Requests whose client left before they finished (counter).
    pub requests_aborted: u64,
    /// Time to first token, simulated seconds.
    pub ttft: Histogram,
    /// Submission to last token, simulated seconds.
    pub e2e: Histogram,
}

/// The events of one request. Dropping it aborts the request (the client
/// left): the engine frees its place in the queue or batch.
#[derive(Debug)]
pub struct EngineStream {
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
}

impl EngineStream {
    /// The next event; `None` after `Finished`.
    pub async fn next(&mut self) -> Option<Event> {
        self.rx.recv().await
    }
}

/// A handle to the running engine (cheap to clone). When the last clone is
/// dropped, the scheduler finishes the requests it has and its task ends.
#[derive(Debug, Clone)]
pub struct Engine {
    inner: Arc<Handle>,
    config: Arc<EngineConfig>,
}

impl Engine {
    /// Starts the scheduler on the current tokio runtime.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime, or if `config` fails
    /// [`EngineConfig::validate`] (validate it first to report the error).
    pub fn start(config: EngineConfig) -> Self {
        Self::spawn(config).0
    }

    /// [`start`](Self::start), also returning the scheduler task.
    fn spawn(config: EngineConfig) -> (Self, JoinHandle<()>) {
        if let Err(e) = config.validate() {
            panic!("invalid engine config: {e}");
        }
        let config = Arc::new(config);
        let state = State {
            cache: PrefixCache::new(config.block_size, config.num_blocks()),
            block_size: config.block_size as usize,
            max_num_seqs: usize::try_from(config.max_num_seqs).unwrap_or(usize::MAX),
            waiting: VecDeque::new(),
            running: Vec::new(),
            clock: None,
            counters: Counters::default(),
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            events: None,
            pins: HashMap::new(),
        };
        let shared = Arc::new(Shared {
            config: Arc::clone(&config),
            state: Mutex::new(state),
            wake: Notify::new(),
            closed: AtomicBool::new(false),
        });
        let task = tokio::spawn(run(Arc::clone(&shared)));
        (
            Self {
                inner: Arc::new(Handle { shared }),
                config,
            },
            task,
        )
    }

    /// Queues a request.
    ///
    /// Rejects an empty prompt, an empty output, prompt + output longer than
    /// `max_model_len`, and a request that alone needs more KV blocks than
    /// the cache has (it could never be admitted). Returns the request's
    /// events; dropping the stream aborts the request.
    pub fn submit(&self, request: EngineRequest) -> Result<EngineStream, SubmitError> {
        self.submit_with(request, KvHandoff::default())
    }

    /// [`submit`](Self::submit) for a leg of disaggregated serving: a
    /// prefill leg whose prompt blocks are held when it finishes, a decode
    /// leg whose prompt KV was pulled (see [`KvHandoff`]).
    pub fn submit_with(&self, request: EngineRequest, handoff: KvHandoff) -> Result<EngineStream, SubmitError> {
        let config = &self.config;
        let EngineRequest {
            prompt,
            output,
            root,
            keys,
        } = request;
        if prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if output.is_empty() {
            return Err(SubmitError::NoOutput);
        }
        let total = prompt.len() as u64 + output.len() as u64;
        if total > u64::from(config.max_model_len) {
            return Err(SubmitError::TooLong {
                prompt: saturating_u32(prompt.len()),
                output: saturating_u32(output.len()),
                max: config.max_model_len,
            });
        }
        let needed = blocks_for(total, config.block_size);
        let capacity = config.num_blocks();
        if needed > capacity {
            return Err(SubmitError::ExceedsKvCapacity { needed, capacity });
        }
        // Hash outside the lock: it is the only per-token work of a request.
        let hashes = chained_hashes(root, prompt.iter().chain(&output).copied(), config.block_size);
        let (tx, rx) = mpsc::unbounded_channel();
        let pending = Pending {
            prompt_len: prompt.len(),
            prompt,
            output,
            hashes,
            keys,
            handoff,
            tx,
            submitted: Instant::now(),
        };
        let shared = &self.inner.shared;
        shared.lock().waiting.push_back(pending);
        shared.wake.notify_one();
        Ok(EngineStream { rx })
    }

    /// Empties the prefix cache (vLLM's `/reset_prefix_cache`); false, and
    /// nothing changed, while a running request holds blocks.
    pub fn reset_prefix_cache(&self) -> bool {
        let mut state = self.inner.shared.lock();
        let reset = state.cache.reset();
        state.collect_events(None);
        state.flush_events();
        reset
    }

    /// The KV cache events from now on: one batch per scheduler step that
    /// stored, evicted or cleared blocks, for [`crate::kv_events::Publisher`]
    /// (a second call replaces the first receiver).
    pub fn kv_events(&self) -> mpsc::UnboundedReceiver<Vec<KvEvent>> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut state = self.inner.shared.lock();
        state.cache.record_events();
        state.cache.take_events();
        state.events = Some(Events { tx, batch: Vec::new() });
        rx
    }

    /// A snapshot of the state and counters, taken under one lock.
    ///
    /// `waiting` may include requests aborted since the last step boundary
    /// (they are dropped at the next one).
    pub fn stats(&self) -> EngineStats {
        let state = self.inner.shared.lock();
        let c = &state.counters;
        EngineStats {
            waiting: state.waiting.len(),
            running: state.running.len(),
            kv_usage: state.cache.usage(),
            num_blocks: state.cache.num_blocks(),
            prefix_cache_queries: c.prefix_cache_queries,
            prefix_cache_hits: c.prefix_cache_hits,
            prompt_tokens: c.prompt_tokens,
            generation_tokens: c.generation_tokens,
            requests_finished: c.requests_finished,
            requests_aborted: c.requests_aborted,
            ttft: state.ttft.clone(),
            e2e: state.e2e.clone(),
        }
    }

    /// The parameters.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Prompt tokens of `prompt` (a request's, with its prefix-cache
    /// `root`) whose KV the prefix cache holds now: its leading cached
    /// full blocks, at most `floor((len - 1) / block_size)` of them (the
    /// last prompt token is always recomputed), in tokens.
    pub fn cached_prefix_tokens(&self, root: u64, prompt: &[u32]) -> usize {
        let block_size = self.config.block_size;
        let hashes = chained_hashes(root, prompt.iter().copied(), block_size);
        let state = self.inner.shared.lock();
        state.cache.lookup(&hashes, prompt.len()) * block_size as usize
    }

    /// The prompt blocks held under `key` ([`KvHandoff::hold_prompt`]), if
    /// they still are.
    pub fn pinned(&self, key: u64) -> Option<PinnedPrompt> {
        self.inner.shared.lock().pins.get(&key).map(|pin| pin.info.clone())
    }

    /// Unpins the prompt blocks held under `key` (they stay cached, as any
    /// finished request's); false if none were.
    pub fn release_pin(&self, key: u64) -> bool {
        let shared = &self.inner.shared;
        let released = shared.lock().release_pin(key);
        if released {
            // Freed blocks may let the queue head in.
            shared.wake.notify_one();
        }
        released
    }

    /// Prompts held for remote decodes now.
    pub fn pins(&self) -> usize {
        self.inner.shared.lock().pins.len()
    }
}

/// `n` as a `u32`, saturating (token counts are bounded by `max_model_len`).
fn saturating_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// What the handles own: dropping the last one tells the scheduler to stop.
struct Handle {
    shared: Arc<Shared>,
}

impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handle").finish_non_exhaustive()
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.wake.notify_one();
    }
}

/// What the handles and the scheduler task share.
struct Shared {
    config: Arc<EngineConfig>,
    state: Mutex<State>,
    /// Wakes the idle scheduler (a submission, or the last handle dropped).
    wake: Notify,
    /// Every handle is gone.
    closed: AtomicBool,
}

impl Shared {
    /// The state. Never held across an `.await`.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("engine state lock poisoned")
    }
}

/// A queued request.
struct Pending {
    prompt_len: usize,
    /// The prompt's tokens (for the KV cache events of its blocks).
    prompt: Vec<u32>,
    output: Vec<u32>,
    /// Block hashes of prompt + output.
    hashes: Vec<BlockHash>,
    keys: BlockKeys,
    handoff: KvHandoff,
    tx: mpsc::UnboundedSender<Event>,
    submitted: Instant,
}

/// A finished prefill's prompt blocks, held for a remote decode.
struct Pin {
    alloc: Allocation,
    /// The request's block hashes (to release the allocation).
    hashes: Vec<BlockHash>,
    info: PinnedPrompt,
}

/// A request in the batch.
struct Running {
    req: Pending,
    alloc: Allocation,
    cached_tokens: usize,
    /// Output tokens produced so far; 0 until the end of its prefill step.
    generated: usize,
}

#[derive(Debug, Default)]
struct Counters {
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
    requests_finished: u64,
    requests_aborted: u64,
}

/// Where the KV cache events go, and the current step's.
struct Events {
    tx: mpsc::UnboundedSender<Vec<KvEvent>>,
    batch: Vec<KvEvent>,
}

/// The scheduler's state (behind `Shared::state`).
struct State {
    cache: PrefixCache,
    block_size: usize,
    max_num_seqs: usize,
    waiting: VecDeque<Pending>,
    running: Vec<Running>,
    /// Virtual end of the last step.
    clock: Option<Instant>,
    counters: Counters,
    ttft: Histogram,
    e2e: Histogram,
    /// The KV cache events' sink, once [`Engine::kv_events`] was called.
    events: Option<Events>,
    /// Prompt blocks held for remote decodes, by key.
    pins: HashMap<u64, Pin>,
}

impl State {
    /// Turns what the cache recorded into wire events, `req` being the
    /// request whose blocks it just allocated or released (its tokens fill
    /// the stored blocks).
    fn collect_events(&mut self, req: Option<&Pending>) {
        let Some(events) = &mut self.events else { return };
        let block_size = self.block_size;
        for e in self.cache.take_events() {
            events.batch.push(match e {
                CacheEvent::Stored { first, hashes, parent } => {
                    let Some(req) = req else { continue };
                    let tokens = req.prompt.iter().chain(&req.output);
                    KvEvent::Stored {
                        token_ids: tokens
                            .skip(first * block_size)
                            .take(hashes.len() * block_size)
                            .copied()
                            .collect(),
                        block_hashes: hashes.into_iter().map(WireHash::from).collect(),
                        parent: parent.map(WireHash::from),
                        block_size: block_size as u32,
                        lora_name: req.keys.lora_name.clone(),
                        // vLLM mixes a salt into a request's first block only.
                        salt: req.keys.salt.clone().filter(|_| first == 0),
                    }
                }
                CacheEvent::Removed(hashes) => KvEvent::Removed(hashes.into_iter().map(WireHash::from).collect()),
                CacheEvent::Cleared => KvEvent::Cleared,
            });
        }
    }

    /// Publishes the step's events, if any.
    fn flush_events(&mut self) {
        if let Some(events) = &mut self.events
            && !events.batch.is_empty()
            && events.tx.send(std::mem::take(&mut events.batch)).is_err()
        {
            // The publisher is gone: stop recording.
            self.events = None;
        }
    }

    fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Drops aborted requests, admits from the queue, and returns the
    /// virtual end of the step, or `None` if there is nothing to run.
    fn begin_step(&mut self, config: &EngineConfig) -> Option<Instant> {
        self.drop_aborted();
        let now = Instant::now();
        // Everyone in the batch at this point is past its prefill.
        let decoding = self.running.len();
        let resumed = self
            .clock
            .filter(|clock| now.saturating_duration_since(*clock) <= MAX_LAG);
        // An idle engine starts the step when its first request arrived, not
        // when the scheduler woke up: the wake-up latency, divided by a small
        // time scale, would otherwise inflate the first TTFT.
        let idle_start = (resumed.is_none() && decoding == 0).then(|| now.checked_sub(MAX_LAG).unwrap_or(now));
        let mut start = resumed.or(idle_start).unwrap_or(now);
        let mut first_admission = idle_start.is_some();
        let mut prefill_tokens = 0u64;
        while self.running.len() < self.max_num_seqs {
            let Some(req) = self.waiting.pop_front() else { break };
            let total = req.prompt_len + req.output.len();
            let Some(alloc) = self.cache.allocate(&req.hashes, req.prompt_len, total) else {
                self.waiting.push_front(req);
                break;
            };
            self.collect_events(Some(&req));
            let hit_tokens = alloc.cached_blocks() * self.block_size;
            let cached_tokens = match req.handoff.pulled_from {
                // Pulled: everything from `from` on but the last token; of
                // the tokens before it, what the cache has.
                Some(from) => {
                    let last = req.prompt_len - 1;
                    let from = from.min(last);
                    hit_tokens.min(from) + (last - from)
                }
                None => hit_tokens,
            };
            self.counters.prefix_cache_queries += req.prompt_len as u64;
            self.counters.prefix_cache_hits += hit_tokens.min(cached_tokens) as u64;
            prefill_tokens += (req.prompt_len - cached_tokens) as u64;
            start = if first_admission {
                start.max(req.submitted).min(now)
            } else {
                start.max(req.submitted)
            };
            first_admission = false;
            self.running.push(Running {
                req,
                alloc,
                cached_tokens,
                generated: 0,
            });
        }
        if self.running.is_empty() {
            if !self.pins.is_empty() {
                // Held prompts keep blocks: the head waits for a release.
                return None;
            }
            // With nothing running every block is free or evictable, and
            // `submit` rejects requests larger than the cache, so the head
            // always fits. Should it not, drop it rather than spin.
            debug_assert!(self.waiting.is_empty(), "the queue head does not fit an idle cache");
            if self.waiting.pop_front().is_some() {
                self.counters.requests_aborted += 1;
            }
            return None;
        }
        let mut simulated = Duration::ZERO;
        if prefill_tokens > 0 {
            simulated += config.prefill_time(prefill_tokens);
        }
        if decoding > 0 {
            simulated += config.decode_step_time(decoding);
        }
        let end = start + config.real(simulated);
        self.clock = Some(end);
        Some(end)
    }

    /// Emits the step's tokens and retires finished and aborted requests.
    fn end_step(&mut self, end: Instant, config: &EngineConfig) {
        let simulated = |since: Instant| end.saturating_duration_since(since).as_secs_f64() / config.time_scale;
        let batch = std::mem::take(&mut self.running);
        self.running.reserve(batch.len());
        for mut r in batch {
            let first = r.generated == 0;
            let id = r.req.output[r.generated];
            r.generated += 1;
            self.counters.generation_tokens += 1;
            let sent = if first {
                self.counters.prompt_tokens += r.req.prompt_len as u64;
                let ttft_s = simulated(r.req.submitted) + r.req.handoff.waited.as_secs_f64();
                let event = Event::FirstToken {
                    id,
                    cached_tokens: saturating_u32(r.cached_tokens),
                    ttft_s,
                };
                let sent = r.req.tx.send(event).is_ok();
                if sent {
                    self.ttft.observe(ttft_s);
                }
                sent
            } else {
                r.req.tx.send(Event::Token { id }).is_ok()
            };
            if !sent {
                self.counters.requests_aborted += 1;
                self.release(r);
            } else if r.generated == r.req.output.len() {
                let usage = Usage {
                    prompt_tokens: saturating_u32(r.req.prompt_len),
                    completion_tokens: saturating_u32(r.req.output.len()),
                    cached_tokens: saturating_u32(r.cached_tokens),
                };
                self.e2e
                    .observe(simulated(r.req.submitted) + r.req.handoff.waited.as_secs_f64());
                self.counters.requests_finished += 1;
                // Held (the caller finds the pin when it reads `Finished`).
                let tx = r.req.tx.clone();
                match r.req.handoff.hold_prompt {
                    Some(key) => self.hold(r, key),
                    None => self.release(r),
                }
                // A client leaving right after the last token changes nothing.
                let _ = tx.send(Event::Finished { usage });
            } else {
                self.running.push(r);
            }
        }
    }

    /// Removes the requests whose stream was dropped.
    fn drop_aborted(&mut self) {
        let queued = self.waiting.len();
        self.waiting.retain(|r| !r.tx.is_closed());
        self.counters.requests_aborted += (queued - self.waiting.len()) as u64;
        if self.running.iter().any(|r| r.req.tx.is_closed()) {
            for r in std::mem::take(&mut self.running) {
                if r.req.tx.is_closed() {
                    self.counters.requests_aborted += 1;
                    self.release(r);
                } else {
                    self.running.push(r);
                }
            }
        }
    }

    /// Ends a prefill leg: registers what it computed, as
    /// [`release`](Self::release) does, but keeps its prompt's blocks
    /// pinned under `key` for a remote decode.
    fn hold(&mut self, r: Running, key: u64) {
        self.release_pin(key);
        let computed = r.req.prompt_len + r.generated.saturating_sub(1);
        let keep = r.req.prompt_len.div_ceil(self.block_size);
        let alloc = self.cache.release_keeping(r.alloc, &r.req.hashes, computed, keep);
        self.collect_events(Some(&r.req));
        let full = (r.req.prompt_len / self.block_size).min(r.req.hashes.len());
        let info = PinnedPrompt {
            block_ids: alloc.block_ids().to_vec(),
            num_tokens: r.req.prompt_len,
            block_hashes: r.req.hashes[..full].to_vec(),
        };
        let hashes = r.req.hashes;
        self.pins.insert(key, Pin { alloc, hashes, info });
    }

    /// Unpins the prompt held under `key`; false if none is.
    fn release_pin(&mut self, key: u64) -> bool {
        let Some(pin) = self.pins.remove(&key) else {
            return false;
        };
        self.cache.release(pin.alloc, &pin.hashes, 0);
        true
    }

    /// Releases a request's blocks, registering the ones it computed: the
    /// prompt and every generated token but the last (whose KV would only
    /// be computed by the next step, as in vLLM).
    fn release(&mut self, r: Running) {
        let computed = r.req.prompt_len + r.generated.saturating_sub(1);
        self.cache.release(r.alloc, &r.req.hashes, computed);
        self.collect_events(Some(&r.req));
    }
}

/// The scheduler loop.
async fn run(shared: Arc<Shared>) {
    let config = Arc::clone(&shared.config);
    loop {
        let end = {
            let mut state = shared.lock();
            let end = state.begin_step(&config);
            state.flush_events();
            end
        };
        match end {
            Some(end) => {
                if end > Instant::now() {
                    tokio::time::sleep_until(end).await;
                } else {
                    // Catching up (or a zero-length step): let others run.
                    tokio::task::yield_now().await;
                }
                let mut state = shared.lock();
                state.end_step(end, &config);
                state.flush_events();
            }
            None => {
                if shared.closed.load(Ordering::Acquire) {
                    // No handle is left, so no submission can arrive, and
                    // no pin can be released but here.
                    let mut state = shared.lock();
                    if state.has_work() {
                        let keys: Vec<u64> = state.pins.keys().copied().collect();
                        for key in keys {
                            state.release_pin(key);
                        }
                        continue;
                    }
                    return;
                }
                shared.wake.notified().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Everything one stream reported.
    #[derive(Debug, Default)]
    struct Outcome {
        tokens: Vec<u32>,
        cached_tokens: u32,
        ttft_s: f64,
        usage: Option<Usage>,
    }

    /// Reads a stream to its end (`None`), checking the event order (the
    /// caller may already have read some events).
    async fn finish(mut stream: EngineStream) -> Outcome {
        let mut o = Outcome::default();
        while let Some(event) = stream.next().await {
            assert!(o.usage.is_none(), "event after Finished: {event:?}");
            match event {
                Event::FirstToken {
                    id,
                    cached_tokens,
                    ttft_s,
                } => {
                    assert!(o.tokens.is_empty(), "FirstToken after tokens");
                    o.tokens.push(id);
                    o.cached_tokens = cached_tokens;
                    o.ttft_s = ttft_s;
                }
                Event::Token { id } => o.tokens.push(id),
                Event::Finished { usage } => o.usage = Some(usage),
            }
        }
        o
    }

    /// The first event, which must be `FirstToken`: (cached tokens, TTFT).
    async fn first(stream: &mut EngineStream) -> (u32, f64) {
        match stream.next().await {
            Some(Event::FirstToken {
                cached_tokens, ttft_s, ..
            }) => (cached_tokens, ttft_s),
            other => panic!("expected FirstToken, got {other:?}"),
        }
    }

    /// A request with prompt `base..base + prompt` and `output` output tokens.
    fn req(base: u32, prompt: u32, output: u32) -> EngineRequest {
        EngineRequest {
            prompt: (base..base + prompt).collect(),
            output: (0..output).map(|i| 900_000 + i).collect(),
            root: 0,
            keys: BlockKeys::default(),
        }
    }

    fn secs(d: Duration) -> f64 {
        d.as_secs_f64()
    }

    fn assert_close(actual: f64, expected: f64) {
        assert!((actual - expected).abs() < 1e-6, "{actual} != {expected}");
    }

    /// Fixed model parameters (independent of the defaults): 16-token
    /// blocks, 25 000 blocks, prefill 20 K tokens/s, decode 8 + 0.08 n ms.
    fn config() -> EngineConfig {
        EngineConfig {
            model_name: "test".into(),
            lora_adapters: Vec::new(),
            block_size: 16,
            kv_capacity_tokens: 400_000,
            max_num_seqs: 256,
            max_model_len: 32_768,
            prefill_tokens_per_s: 20_000.0,
            decode_step_base_ms: 8.0,
            decode_step_per_seq_ms: 0.08,
            default_output_tokens: 128,
            time_scale: 1.0,
        }
    }

    /// Every event batch published so far, flattened.
    fn drain(rx: &mut mpsc::UnboundedReceiver<Vec<KvEvent>>) -> Vec<KvEvent> {
        std::iter::from_fn(|| rx.try_recv().ok()).flatten().collect()
    }

    #[tokio::test(start_paused = true)]
    async fn kv_events_tell_what_the_cache_stored_evicted_and_cleared() {
        // 4 blocks of 16 tokens: a second 48-token request evicts the first's.
        let engine = Engine::start(EngineConfig {
            kv_capacity_tokens: 64,
            ..config()
        });
        let mut rx = engine.kv_events();
        let first = EngineRequest {
            keys: BlockKeys {
                lora_name: None,
                salt: Some("s1".into()),
            },
            ..req(0, 40, 10)
        };
        finish(engine.submit(first.clone()).unwrap()).await;
        let events = drain(&mut rx);
        let hashes = chained_hashes(0, first.prompt.iter().chain(&first.output).copied(), 16);
        // At admission its two full prompt blocks; at its end the third,
        // which its prompt and answer filled (40 + 10 - 1 computed tokens).
        assert_eq!(
            events,
            [
                KvEvent::Stored {
                    block_hashes: hashes[..2].iter().map(|h| WireHash::from(*h)).collect(),
                    parent: None,
                    token_ids: (0..32).collect(),
                    block_size: 16,
                    lora_name: None,
                    salt: Some("s1".into()),
                },
                KvEvent::Stored {
                    block_hashes: vec![WireHash::from(hashes[2])],
                    parent: Some(WireHash::from(hashes[1])),
                    token_ids: (32..40).chain(900_000..900_008).collect(),
                    block_size: 16,
                    lora_name: None,
                    salt: None,
                },
            ]
        );
        // A request of 4 blocks needs them all: the first's three go.
        finish(engine.submit(req(1000, 60, 4)).unwrap()).await;
        let events = drain(&mut rx);
        let KvEvent::Removed(removed) = &events[0] else {
            panic!("{events:?}")
        };
        let mut removed: Vec<WireHash> = removed.clone();
        removed.sort_by_key(|h| format!("{h:?}"));
        let mut expected: Vec<WireHash> = hashes[..3].iter().map(|h| WireHash::from(*h)).collect();
        expected.sort_by_key(|h| format!("{h:?}"));
        assert_eq!(removed, expected);
        assert!(matches!(&events[1], KvEvent::Stored { parent: None, token_ids, .. } if token_ids[0] == 1000));
        assert!(engine.reset_prefix_cache());
        assert_eq!(drain(&mut rx), [KvEvent::Cleared]);
    }

    #[tokio::test(start_paused = true)]
    async fn cold_prompt_ttft_is_its_prefill_time() {
        let cfg = config();
        let engine = Engine::start(cfg.clone());
        let r = req(0, 2000, 5);
        let out = finish(engine.submit(r.clone()).expect("accepted")).await;
        assert_eq!(out.cached_tokens, 0);
        assert_close(out.ttft_s, secs(cfg.prefill_time(2000)));
        assert_close(out.ttft_s, 0.1);
        assert_eq!(out.tokens, r.output);
        assert_eq!(
            out.usage,
            Some(Usage {
                prompt_tokens: 2000,
                completion_tokens: 5,
                cached_tokens: 0
            })
        );
    }

    /// In real time (no paused clock) at a small time scale, the scheduler's
    /// wake-up latency must not leak into the TTFT: an idle engine's step
    /// starts when the request arrived, so the TTFT is exactly the prefill.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cold_ttft_excludes_the_wake_up_latency_in_real_time() {
        let cfg = EngineConfig {
            time_scale: 0.01,
            ..config()
        };
        let engine = Engine::start(cfg.clone());
        for base in [0u32, 10_000, 20_000] {
            let out = finish(engine.submit(req(base, 6, 2)).expect("accepted")).await;
            assert_close(out.ttft_s, secs(cfg.prefill_time(6)));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn repeated_prompt_hits_the_cache_and_has_a_lower_ttft() {
        let cfg = config();
        let engine = Engine::start(cfg.clone());
        let cold = finish(engine.submit(req(0, 2000, 4)).expect("accepted")).await;
        let warm = finish(engine.submit(req(0, 2000, 4)).expect("accepted")).await;
        // floor((2000 - 1) / 16) = 124 blocks; the last 16 tokens are recomputed.
        assert_eq!(warm.cached_tokens, 1984);
        assert_eq!(warm.usage.map(|u| u.cached_tokens), Some(1984));
        assert_close(warm.ttft_s, secs(cfg.prefill_time(16)));
        assert!(warm.ttft_s < cold.ttft_s / 10.0);
        let stats = engine.stats();
        assert_eq!(stats.prefix_cache_queries, 4000);
        assert_eq!(stats.prefix_cache_hits, 1984);
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_identical_prompts_share_blocks_from_admission() {
        // vLLM registers prompt blocks when it schedules them, so a request
        // admitted with (or after) a running one shares its prefix.
        let cfg = config();
        let engine = Engine::start(cfg.clone());
        let a = engine.submit(req(0, 2000, 3)).expect("accepted");
        let b = engine.submit(req(0, 2000, 3)).expect("accepted");
        let (a, b) = (finish(a).await, finish(b).await);
        assert_eq!((a.cached_tokens, b.cached_tokens), (0, 1984));
        // Both were prefilled in the same step: 2000 + 16 tokens.
        assert_close(a.ttft_s, secs(cfg.prefill_time(2016)));
        assert_close(b.ttft_s, a.ttft_s);
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_turn_hits_the_first_turns_prompt_and_answer() {
        let engine = Engine::start(config());
        let turn1 = req(0, 100, 60);
        finish(engine.submit(turn1.clone()).expect("accepted")).await;
        let mut prompt2 = turn1.prompt.clone();
        prompt2.extend(&turn1.output);
        prompt2.extend(5000..5030);
        let out = finish(
            engine
                .submit(EngineRequest {
                    prompt: prompt2,
                    output: vec![1, 2],
                    root: 0,
                    keys: BlockKeys::default(),
                })
                .expect("accepted"),
        )
        .await;
        // Turn 1 computed 100 + 59 tokens: 9 full blocks (prompt + most of the answer).
        assert_eq!(out.cached_tokens, 144);
    }

    #[tokio::test(start_paused = true)]
    async fn one_output_token_finishes_right_after_prefill() {
        let engine = Engine::start(config());
        let mut stream = engine.submit(req(0, 100, 1)).expect("accepted");
        let (_, ttft) = first(&mut stream).await;
        assert_eq!(
            stream.next().await,
            Some(Event::Finished {
                usage: Usage {
                    prompt_tokens: 100,
                    completion_tokens: 1,
                    cached_tokens: 0
                }
            })
        );
        assert_eq!(stream.next().await, None);
        let stats = engine.stats();
        assert_close(stats.e2e.sum(), ttft);
        assert_eq!((stats.running, stats.kv_usage), (0, 0.0));
    }

    #[tokio::test(start_paused = true)]
    async fn full_batch_queues_requests_and_drains() {
        let cfg = EngineConfig {
            max_num_seqs: 4,
            ..config()
        };
        let engine = Engine::start(cfg.clone());
        let mut streams: Vec<_> = (0..6)
            .map(|i| engine.submit(req(i * 1000, 100, 10)).expect("accepted"))
            .collect();
        // The engine has not run yet: everything waits.
        assert_eq!((engine.stats().waiting, engine.stats().running), (6, 0));
        first(&mut streams[0]).await;
        let stats = engine.stats();
        assert_eq!((stats.waiting, stats.running), (2, 4));
        // At every step boundary: waiting > 0 exactly when the batch is full.
        while let Some(event) = streams[0].next().await {
            let stats = engine.stats();
            assert_eq!(stats.waiting > 0, stats.running == 4, "{event:?}: {stats:?}");
        }
        let mut outcomes = Vec::new();
        for s in streams.drain(1..) {
            outcomes.push(finish(s).await);
        }
        let stats = engine.stats();
        assert_eq!((stats.waiting, stats.running, stats.requests_finished), (0, 0, 6));
        assert_eq!(stats.kv_usage, 0.0);
        // Requests 5 and 6 were admitted when the first four finished: after
        // their prefill step and 9 decode steps of 4 sequences.
        let expected = secs(cfg.prefill_time(400) + cfg.decode_step_time(4) * 9 + cfg.prefill_time(200));
        assert_close(outcomes[3].ttft_s, expected);
        assert_close(outcomes[4].ttft_s, expected);
        assert_close(outcomes[0].ttft_s, secs(cfg.prefill_time(400)));
    }

    #[tokio::test(start_paused = true)]
    async fn kv_bound_admission_waits_for_blocks() {
        // 10 blocks of 16 tokens; each request needs ceil((40 + 24) / 16) = 4.
        let cfg = EngineConfig {
            kv_capacity_tokens: 160,
            ..config()
        };
        let engine = Engine::start(cfg.clone());
        let mut a = engine.submit(req(0, 40, 24)).expect("accepted");
        let b = engine.submit(req(1000, 40, 24)).expect("accepted");
        let c = engine.submit(req(2000, 40, 24)).expect("accepted");
        first(&mut a).await;
        let stats = engine.stats();
        assert_eq!(
            (stats.running, stats.waiting),
            (2, 1),
            "the third does not fit in the 2 blocks left"
        );
        assert_close(stats.kv_usage, 0.8);
        let (a, b, c) = (finish(a).await, finish(b).await, finish(c).await);
        assert_eq!(a.tokens.len(), 23, "the first token was read above");
        assert_eq!(b.tokens.len(), 24);
        // C was admitted after A and B finished (1 prefill + 23 decode steps).
        let expected = secs(cfg.prefill_time(80) + cfg.decode_step_time(2) * 23 + cfg.prefill_time(40));
        assert_close(c.ttft_s, expected);
        let stats = engine.stats();
        assert_eq!((stats.running, stats.waiting, stats.kv_usage), (0, 0, 0.0));
        assert_eq!(stats.num_blocks, 10);
    }

    #[tokio::test(start_paused = true)]
    async fn kv_bound_queue_is_strict_fifo() {
        // The head needs 6 of 10 blocks while 8 are held: a small request
        // behind it that would fit is not admitted before it.
        let cfg = EngineConfig {
            kv_capacity_tokens: 160,
            ..config()
        };
        let engine = Engine::start(cfg.clone());
        let mut big = engine.submit(req(0, 100, 28)).expect("accepted"); // 8 blocks
        first(&mut big).await;
        let head = engine.submit(req(1000, 80, 16)).expect("accepted"); // 6 blocks
        let small = engine.submit(req(2000, 10, 2)).expect("accepted"); // 1 block
        big.next().await;
        let stats = engine.stats();
        assert_eq!((stats.running, stats.waiting), (1, 2));
        finish(big).await;
        let (head, small) = (finish(head).await, finish(small).await);
        assert!(
            small.ttft_s >= head.ttft_s - 1e-9,
            "small overtook the head: {small:?} vs {head:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn decode_steps_slow_down_with_batch_size() {
        let cfg = EngineConfig {
            max_num_seqs: 64,
            ..config()
        };
        // Per-token latency after the first token, from the histograms (exact).
        let per_token = |s: &EngineStats| (s.e2e.sum() - s.ttft.sum()) / s.e2e.count() as f64 / 100.0;

        let engine = Engine::start(cfg.clone());
        let mut stream = engine.submit(req(0, 16, 101)).expect("accepted");
        first(&mut stream).await;
        let t0 = Instant::now();
        finish(stream).await;
        let real = secs(t0.elapsed());
        let alone = per_token(&engine.stats());
        assert_close(alone, secs(cfg.decode_step_time(1)));
        // The client sees the same pace (tokio timers round up to 1 ms).
        assert!((real - 100.0 * alone).abs() < 0.002, "{real}");

        let engine = Engine::start(cfg.clone());
        let streams: Vec<_> = (0..32)
            .map(|i| engine.submit(req(i * 100, 16, 101)).expect("accepted"))
            .collect();
        for s in streams {
            finish(s).await;
        }
        let batched = per_token(&engine.stats());
        assert_close(batched, secs(cfg.decode_step_time(32)));
        assert!(batched > alone * 1.25, "{batched} vs {alone}");
    }

    #[tokio::test(start_paused = true)]
    async fn aborting_a_queued_request_frees_its_place() {
        let cfg = EngineConfig {
            max_num_seqs: 1,
            ..config()
        };
        let engine = Engine::start(cfg.clone());
        let a = engine.submit(req(0, 16, 5)).expect("accepted");
        let b = engine.submit(req(100, 16, 5)).expect("accepted");
        let c = engine.submit(req(200, 16, 5)).expect("accepted");
        drop(b);
        let (a, c) = (finish(a).await, finish(c).await);
        assert_eq!(a.tokens.len(), 5);
        // C followed A directly: B never took a turn.
        let expected = secs(cfg.prefill_time(16) + cfg.decode_step_time(1) * 4 + cfg.prefill_time(16));
        assert_close(c.ttft_s, expected);
        let stats = engine.stats();
        assert_eq!((stats.requests_aborted, stats.requests_finished), (1, 2));
        assert_eq!(stats.prefix_cache_queries, 32, "B was never looked up");
        assert_eq!(stats.waiting, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dead_queue_head_does_not_block_the_queue() {
        let cfg = EngineConfig {
            max_num_seqs: 1,
            ..config()
        };
        let engine = Engine::start(cfg.clone());
        let mut a = engine.submit(req(0, 16, 50)).expect("accepted");
        first(&mut a).await;
        let b = engine.submit(req(100, 16, 5)).expect("accepted");
        let c = engine.submit(req(200, 16, 5)).expect("accepted");
        assert_eq!(engine.stats().waiting, 2);
        drop(b);
        a.next().await;
        assert_eq!(engine.stats().waiting, 1, "B left the queue at the step boundary");
        finish(a).await;
        assert_eq!(finish(c).await.tokens.len(), 5);
    }

    #[tokio::test(start_paused = true)]
    async fn aborting_a_running_request_frees_its_blocks_and_keeps_its_prompt_cached() {
        let cfg = EngineConfig {
            max_num_seqs: 1,
            ..config()
        };
        let engine = Engine::start(cfg.clone());
        let mut a = engine.submit(req(0, 2000, 1000)).expect("accepted");
        let b = engine.submit(req(5000, 16, 2)).expect("accepted");
        first(&mut a).await;
        assert_eq!((engine.stats().running, engine.stats().waiting), (1, 1));
        drop(a);
        let b = finish(b).await;
        // B started at most one decode step after A's prefill, not after A's 1000 tokens.
        let latest = secs(cfg.prefill_time(2000) + cfg.decode_step_time(1) + cfg.prefill_time(16));
        assert!(b.ttft_s <= latest + 1e-6, "{}", b.ttft_s);
        let stats = engine.stats();
        assert_eq!((stats.requests_aborted, stats.requests_finished), (1, 1));
        assert_eq!((stats.running, stats.waiting, stats.kv_usage), (0, 0, 0.0));
        // A's prompt was computed, so it is cached.
        let again = finish(engine.submit(req(0, 2000, 2)).expect("accepted")).await;
        assert_eq!(again.cached_tokens, 1984);
    }

    #[tokio::test(start_paused = true)]
    async fn invalid_requests_are_rejected() {
        let cfg = EngineConfig {
            kv_capacity_tokens: 160,
            max_model_len: 1000,
            ..config()
        };
        let engine = Engine::start(cfg);
        let submit = |prompt: u32, output: u32| engine.submit(req(0, prompt, output)).map(|_| ());
        assert_eq!(submit(0, 5), Err(SubmitError::EmptyPrompt));
        assert_eq!(submit(5, 0), Err(SubmitError::NoOutput));
        assert_eq!(
            submit(900, 101),
            Err(SubmitError::TooLong {
                prompt: 900,
                output: 101,
                max: 1000
            })
        );
        assert_eq!(
            submit(150, 11),
            Err(SubmitError::ExceedsKvCapacity {
                needed: 11,
                capacity: 10
            })
        );
        assert_eq!(submit(150, 10), Ok(()), "exactly the whole cache");
        let stats = engine.stats();
        assert_eq!(stats.waiting, 1);
        assert_eq!(stats.prefix_cache_queries, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn counters_and_histograms_move() {
        let cfg = config();
        let engine = Engine::start(cfg.clone());
        let before = engine.stats();
        assert_eq!(before.num_blocks, cfg.num_blocks());
        assert_eq!(
            (before.ttft.count(), before.e2e.count(), before.generation_tokens),
            (0, 0, 0)
        );
        let mut s = engine.submit(req(0, 500, 10)).expect("accepted");
        assert_eq!(
            engine.stats().prompt_tokens,
            0,
            "prompt tokens count at prefill, not at submission"
        );
        first(&mut s).await;
        assert_eq!(engine.stats().prompt_tokens, 500);
        assert_eq!(engine.stats().generation_tokens, 1);
        assert!(engine.stats().kv_usage > 0.0);
        finish(s).await;
        finish(engine.submit(req(0, 500, 10)).expect("accepted")).await;
        let s = engine.stats();
        assert_eq!(s.prompt_tokens, 1000);
        assert_eq!(s.generation_tokens, 20);
        assert_eq!((s.requests_finished, s.requests_aborted), (2, 0));
        assert_eq!(s.prefix_cache_queries, 1000);
        assert_eq!(s.prefix_cache_hits, 496);
        assert_eq!((s.ttft.count(), s.e2e.count()), (2, 2));
        assert_eq!(s.ttft.bounds(), TTFT_BUCKETS);
        assert_eq!(s.e2e.bounds(), E2E_BUCKETS);
        // TTFTs of 25 ms (cold) and 0.2 ms (4 uncached tokens); e2e of ~98 ms and ~73 ms.
        assert_eq!(s.ttft.cumulative()[..5], [1, 1, 1, 1, 2]);
        assert_eq!(s.e2e.cumulative()[0], 2);
        assert!(s.e2e.sum() > s.ttft.sum());
    }

    #[tokio::test(start_paused = true)]
    async fn ttft_is_reported_in_simulated_seconds() {
        // 100x faster than real time; an 8 ms decode step lasts 80 µs, below
        // tokio's 1 ms timer resolution: the virtual clock keeps it exact.
        let cfg = EngineConfig {
            time_scale: 0.01,
            ..config()
        };
        let engine = Engine::start(cfg.clone());
        let t0 = Instant::now();
        let mut s = engine.submit(req(0, 2000, 101)).expect("accepted");
        let (_, ttft) = first(&mut s).await;
        assert_close(ttft, 0.1);
        assert!(t0.elapsed() <= Duration::from_millis(2), "{:?}", t0.elapsed());
        finish(s).await;
        let real = t0.elapsed();
        let stats = engine.stats();
        assert_close(
            stats.e2e.sum(),
            secs(cfg.prefill_time(2000) + cfg.decode_step_time(1) * 100),
        );
        // 0.908 simulated seconds take ~9.1 ms.
        assert!(
            real >= Duration::from_micros(9000) && real <= Duration::from_micros(10_500),
            "{real:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_loop_ends_when_every_handle_is_dropped() {
        let (engine, task) = Engine::spawn(config());
        let other = engine.clone();
        finish(engine.submit(req(0, 10, 2)).expect("accepted")).await;
        drop(engine);
        assert!(!task.is_finished(), "a clone is still alive");
        drop(other);
        let ended = tokio::time::timeout(Duration::from_secs(60), task).await;
        assert!(matches!(ended, Ok(Ok(()))), "{ended:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_the_handles_lets_in_flight_requests_finish() {
        let (engine, task) = Engine::spawn(config());
        let a = engine.submit(req(0, 100, 20)).expect("accepted");
        let b = engine.submit(req(1000, 100, 20)).expect("accepted");
        drop(engine);
        drop(b);
        let a = finish(a).await;
        assert_eq!(a.tokens.len(), 20);
        assert!(a.usage.is_some());
        let ended = tokio::time::timeout(Duration::from_secs(60), task).await;
        assert!(matches!(ended, Ok(Ok(()))), "{ended:?}");
    }

    #[test]
    #[should_panic(expected = "invalid engine config")]
    fn an_invalid_config_is_refused() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        rt.block_on(async {
            Engine::start(EngineConfig {
                block_size: 0,
                ..config()
            });
        });
    }

    #[tokio::test(start_paused = true)]
    async fn a_pulled_prompt_costs_only_its_last_token() {
        let cfg = config();
        let engine = Engine::start(cfg.clone());
        // 100 prompt tokens pulled from token 0: 99 count as cached.
        let handoff = KvHandoff {
            pulled_from: Some(0),
            waited: Duration::from_millis(7),
            ..KvHandoff::default()
        };
        let mut s = engine.submit_with(req(0, 100, 3), handoff).expect("accepted");
        let (cached, ttft) = first(&mut s).await;
        assert_eq!(cached, 99);
        assert_close(ttft, secs(cfg.prefill_time(1)) + 0.007);
        let out = finish(s).await;
        assert_eq!(out.usage.expect("usage").cached_tokens, 99);
        let stats = engine.stats();
        assert_eq!(stats.prefix_cache_hits, 0, "pulled tokens are not local hits");
        assert_close(
            stats.e2e.sum(),
            secs(cfg.prefill_time(1) + cfg.decode_step_time(1) * 2) + 0.007,
        );
        // The pulled blocks are cached now: a plain repeat hits them.
        let again = finish(engine.submit(req(0, 100, 2)).expect("accepted")).await;
        assert_eq!(again.cached_tokens, 96);
    }

    #[tokio::test(start_paused = true)]
    async fn a_pull_from_past_the_local_prefix_recomputes_the_gap() {
        let engine = Engine::start(config());
        // Only 32 tokens are cached locally; the pull started at token 64.
        finish(engine.submit(req(0, 40, 1)).expect("accepted")).await;
        assert_eq!(engine.cached_prefix_tokens(0, &(0..100).collect::<Vec<_>>()), 32);
        let handoff = KvHandoff {
            pulled_from: Some(64),
            ..KvHandoff::default()
        };
        let mut s = engine.submit_with(req(0, 100, 1), handoff).expect("accepted");
        // 32 cached + 35 pulled (64..99); 32..64 and the last token computed.
        assert_eq!(first(&mut s).await.0, 67);
    }

    #[tokio::test(start_paused = true)]
    async fn a_held_prompt_stays_pinned_until_released() {
        let cfg = EngineConfig {
            kv_capacity_tokens: 160,
            ..config()
        };
        let engine = Engine::start(cfg);
        let handoff = KvHandoff {
            hold_prompt: Some(7),
            ..KvHandoff::default()
        };
        // 100 prompt tokens: 7 blocks, the last partial.
        finish(engine.submit_with(req(0, 100, 1), handoff).expect("accepted")).await;
        let pinned = engine.pinned(7).expect("held");
        assert_eq!(pinned.num_tokens, 100);
        assert_eq!(pinned.block_ids.len(), 7);
        assert_eq!(pinned.block_hashes.len(), 6);
        assert_eq!(engine.pins(), 1);
        assert_close(engine.stats().kv_usage, 0.7);
        // A request needing 4 blocks waits for the pin's release.
        let mut waiting = engine.submit(req(1000, 50, 10)).expect("accepted");
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(engine.stats().waiting, 1);
        assert!(engine.release_pin(7));
        assert!(!engine.release_pin(7), "released once");
        assert_eq!(engine.pinned(7), None);
        first(&mut waiting).await;
        finish(waiting).await;
        assert_eq!(engine.stats().kv_usage, 0.0);
        // The held prompt stayed cached.
        assert_eq!(engine.cached_prefix_tokens(0, &(0..100).collect::<Vec<_>>()), 96);
    }

    #[tokio::test(start_paused = true)]
    async fn kv_events_of_both_legs_say_what_each_engine_holds() {
        // A prefill engine and a decode engine of 8 blocks each.
        let cfg = EngineConfig {
            kv_capacity_tokens: 128,
            ..config()
        };
        let (prefill, decode) = (Engine::start(cfg.clone()), Engine::start(cfg));
        let (mut p_rx, mut d_rx) = (prefill.kv_events(), decode.kv_events());
        let stored = |hashes: &[BlockHash], parent: Option<BlockHash>, token_ids: Vec<u32>| KvEvent::Stored {
            block_hashes: hashes.iter().map(|h| WireHash::from(*h)).collect(),
            parent: parent.map(WireHash::from),
            token_ids,
            block_size: 16,
            lora_name: None,
            salt: None,
        };
        // The prefill leg: its 6 full prompt blocks (of 100 tokens), stored
        // at admission, stay pinned for the decode; their release frees
        // them as a finished request's (still cached: nothing evicted).
        let leg = req(0, 100, 1);
        let hold = KvHandoff {
            hold_prompt: Some(1),
            ..KvHandoff::default()
        };
        finish(prefill.submit_with(leg.clone(), hold).expect("accepted")).await;
        let hashes = chained_hashes(0, leg.prompt.iter().copied(), 16);
        assert_eq!(drain(&mut p_rx), [stored(&hashes[..6], None, (0..96).collect())]);
        assert!(prefill.release_pin(1));
        assert_eq!(drain(&mut p_rx), []);
        assert_eq!(prefill.cached_prefix_tokens(0, &leg.prompt), 96);
        // The decode leg pulled the prompt: its full blocks are stored at
        // admission (as vLLM caches them once the KV arrived), and the
        // block its answer filled at its end (100 + 20 - 1 computed).
        let turn = req(0, 100, 20);
        let pulled = KvHandoff {
            pulled_from: Some(0),
            ..KvHandoff::default()
        };
        finish(decode.submit_with(turn.clone(), pulled.clone()).expect("accepted")).await;
        let all = chained_hashes(0, turn.prompt.iter().chain(&turn.output).copied(), 16);
        assert_eq!(
            drain(&mut d_rx),
            [
                stored(&all[..6], None, (0..96).collect()),
                stored(&all[6..7], Some(all[5]), (96..100).chain(900_000..900_012).collect()),
            ]
        );
        // Another pulled prompt needs all 8 blocks: the first's 7 are
        // evicted (tail first), then its own are stored.
        let next = req(5000, 100, 20);
        finish(decode.submit_with(next.clone(), pulled).expect("accepted")).await;
        let events = drain(&mut d_rx);
        let removed: Vec<WireHash> = all[..7].iter().rev().map(|h| WireHash::from(*h)).collect();
        assert_eq!(events[0], KvEvent::Removed(removed), "{events:?}");
        let next_hashes = chained_hashes(0, next.prompt.iter().copied(), 16);
        assert_eq!(events[1], stored(&next_hashes[..6], None, (5000..5096).collect()));
        assert_eq!(events.len(), 3, "and its answer's block: {events:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_prefill_admitted_beside_a_decode_slows_its_step() {
        // Aggregated-engine interference: the step that admits B's 2 000
        // prompt tokens lasts their prefill time, and A waits for it.
        let cfg = config();
        let engine = Engine::start(cfg.clone());
        let mut a = engine.submit(req(0, 16, 10)).expect("accepted");
        first(&mut a).await;
        let t0 = Instant::now();
        a.next().await;
        let b = engine.submit(req(5000, 2000, 1)).expect("accepted");
        let out = finish(a).await;
        let real = secs(t0.elapsed());
        assert_eq!(out.tokens.len(), 8, "two were read above");
        let alone = secs(cfg.decode_step_time(1) * 9);
        assert!(
            (real - alone - secs(cfg.prefill_time(2000))).abs() < 0.003,
            "{real} vs {alone} + the prefill"
        );
        // B arrived during a decode step and waited for its end (at most
        // one step); its one token then cost one step: its prefill and
        // A's decode step.
        let b = finish(b).await;
        let one_step = secs(cfg.prefill_time(2000) + cfg.decode_step_time(1));
        assert!(
            b.ttft_s >= one_step - 1e-6 && b.ttft_s <= one_step + secs(cfg.decode_step_time(1)) + 1e-6,
            "{}",
            b.ttft_s
        );
    }
}
