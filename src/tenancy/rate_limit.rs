//! Rate limits per tenant and per model: requests and tokens per minute,
//! enforced across every dispatcher of a host (shared memory) or of every
//! host (Redis).
//!
//! # What is limited
//!
//! | where it is set | bucket | counts |
//! | --- | --- | --- |
//! | keys file, `[[tenant]]` (`name = "*"`: each tenant without its own entry) | one per tenant and unit | that tenant's requests, on every model |
//! | `[[model]]` | one per model and unit | every tenant's requests to that model (aliases and all) |
//!
//! `requests_per_minute` counts requests; `tokens_per_minute` counts prompt
//! and output tokens. A request is let in with its prompt tokens **and a
//! reservation for its output** taken from its token buckets: the output
//! it asked for (`max_tokens`, `max_completion_tokens`) times the answers
//! it asked for (`n`, `best_of`), at most the room left in the largest
//! live engine's context, else `limits.reserve_output_tokens` (default
//! 4 096) when it asked for no limit; never more than the bucket's limit
//! less the prompt, so a prompt that fits is never refused for its
//! `max_tokens`. When the answer ends, however it ends, the reservation is
//! settled ([`OutputBuckets::settle`]): the unused part is given back, and
//! output beyond it is charged whether or not there is room (the answer
//! was given): the bucket goes into debt, at most
//! [`shm_layout::limit_table::DEBT_PERIODS`] periods deep, and the next
//! requests wait it out. An answer's output is the engine's reported
//! usage (`usage.completion_tokens`, `usage.output_tokens`), which the
//! gateway always asks a stream for; else an estimate, a token per four
//! bytes of everything generated in every choice (text, tool calls,
//! reasoning), never 0 for an answer with text (an answer cut short by its
//! client is charged for what was relayed; a request that got no answer
//! gets its whole reservation back). A request is let in only when
//! **every** bucket it is charged to has room ([`take`]: the units taken
//! from the earlier buckets are given back when a later one refuses), so a
//! refused request costs nothing. Other `/v1/...` requests (embeddings,
//! ...) are charged one request and an estimate of their prompt (a token
//! per four bytes of body). An answer from the response cache counts as a
//! request with its prompt tokens (the check comes before the cache is
//! read), and no output tokens.
//!
//! A tenant may also have `max_concurrent_requests`: its requests in flight
//! at once on a gateway host, across its dispatchers, streams included
//! until they end; one more gets 429 `concurrency_limit_exceeded`
//! (`crate::dispatcher::concurrency`).
//!
//! In the segment's table, a bucket lives in one of the eight slots of its
//! probe window; a new bucket whose window is full of other live buckets
//! waits (429, with when to retry) rather than evict one, which would start
//! that key again from a full bucket (16 384 slots: a window fills only
//! when the table nears full).
//!
//! The buckets are GCRA buckets ([`shm_layout::limit_table`]): a minute's
//! worth of burst, refilled continuously (a limit of 60 per minute gives
//! one more request every second, not 60 at the top of each minute).
//!
//! # What a client sees
//!
//! Every answer to a request with limits carries OpenAI's headers for the
//! bucket of each unit with the least room: `x-ratelimit-limit-requests`,
//! `x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests` (the
//! time until the bucket is full again, as OpenAI writes it: `1s`,
//! `6m0s`, `20ms`), and the same for `-tokens`. A refused request gets 429
//! `rate_limit_exceeded` (`type` `requests` or `tokens`), with
//! `Retry-After` (seconds, rounded up) and `retry-after-ms`. A prompt
//! larger than a whole minute of its tokens limit can never pass: 429
//! with no `Retry-After`, saying so.

use std::sync::Arc;

use http::HeaderMap;
use http::header::HeaderValue;
use serde::{Deserialize, Serialize};
use shm_layout::limit_table::{BucketState, LimitTable, Quota, Taken};

/// Requests and tokens per minute (`None`: not limited).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateLimits {
    /// Requests per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    /// Prompt and output tokens per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
}

impl RateLimits {
    /// Whether it limits nothing.
    pub fn is_empty(&self) -> bool {
        self.requests_per_minute.is_none() && self.tokens_per_minute.is_none()
    }

    /// Whether both limits, where set, are at least 1; else the field
    /// that is not.
    pub fn check(&self) -> Result<(), &'static str> {
        for (name, v) in [
            ("requests_per_minute", self.requests_per_minute),
            ("tokens_per_minute", self.tokens_per_minute),
        ] {
            if v == Some(0) {
                return Err(name);
            }
        }
        Ok(())
    }

    /// Why [`check`](Self::check) refuses a limit.
    pub const AT_LEAST_ONE: &'static str = "must be at least 1 (leave it out for no limit)";

    /// Its buckets for `scope` `name`.
    pub fn buckets(&self, scope: Scope, name: &str) -> Vec<Bucket> {
        let owner: Arc<str> = Arc::from(name);
        [
            (Unit::Requests, self.requests_per_minute),
            (Unit::Tokens, self.tokens_per_minute),
        ]
        .into_iter()
        .filter_map(|(unit, limit)| {
            let limit = limit?;
            Some(Bucket {
                key: bucket_key(scope, unit, name),
                quota: Quota::per_minute(limit),
                unit,
                scope,
                owner: owner.clone(),
            })
        })
        .collect()
    }
}

/// What a bucket counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Requests.
    Requests,
    /// Prompt and output tokens.
    Tokens,
}

impl Unit {
    /// Its name in headers and error types.
    pub fn name(self) -> &'static str {
        match self {
            Unit::Requests => "requests",
            Unit::Tokens => "tokens",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Unit::Requests => "RPM",
            Unit::Tokens => "TPM",
        }
    }
}

/// Whose bucket it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// A tenant's (keys file).
    Tenant,
    /// A model's (every tenant's requests to it).
    Model,
}

impl Scope {
    fn name(self) -> &'static str {
        match self {
            Scope::Tenant => "tenant",
            Scope::Model => "model",
        }
    }
}

/// The key of `scope` `name`'s bucket of `unit` in the limit table (the
/// same on every host and every process).
fn bucket_key(scope: Scope, unit: Unit, name: &str) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&[scope as u8, unit as u8, 0]);
    h.update(name.as_bytes());
    h.digest()
}

/// One token bucket a request is charged to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Its key in the table.
    pub key: u64,
    /// Its limit.
    pub quota: Quota,
    /// What it counts.
    pub unit: Unit,
    /// Whose it is.
    pub scope: Scope,
    /// The tenant or model it is for (in messages).
    pub owner: Arc<str>,
}

impl Bucket {
    /// `n` units of it.
    pub fn charge(&self, n: u64) -> Charge {
        Charge {
            key: self.key,
            quota: self.quota,
            n,
        }
    }

    /// `tenant 'acme' on tokens per min (TPM): Limit 1000`, as OpenAI's
    /// limit messages name a bucket.
    fn described(&self) -> String {
        format!(
            "{} '{}' on {} per min ({}): Limit {}",
            self.scope.name(),
            self.owner,
            self.unit.name(),
            self.unit.short(),
            self.quota.limit
        )
    }
}

/// `n` units of a bucket, as a store takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    /// The bucket's key.
    pub key: u64,
    /// Its limit.
    pub quota: Quota,
    /// Units.
    pub n: u64,
}

/// What a store says of a request's charges ([`take`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// All taken; each bucket after its charge, in the charges' order.
    Allowed(Vec<BucketState>),
    /// None taken: charge `index`'s bucket has no room now.
    Limited {
        /// Which charge.
        index: usize,
        /// Its bucket as it is.
        state: BucketState,
        /// When it will have room.
        retry_after_ns: u64,
    },
    /// None taken: charge `index` is more than its bucket ever holds.
    TooLarge {
        /// Which charge.
        index: usize,
    },
}

/// Takes every charge from `table` at `now_ns`, or none: the shared-memory
/// check (a charge taken before a later one is refused is given back).
pub fn take(table: &LimitTable<'_>, charges: &[Charge], now_ns: u64) -> Verdict {
    let mut states = Vec::with_capacity(charges.len());
    for (index, c) in charges.iter().enumerate() {
        let refused = match table.take(c.key, c.quota, c.n, now_ns) {
            Taken::Allowed(state) => {
                states.push(state);
                continue;
            }
            Taken::Limited { state, retry_after_ns } => Verdict::Limited {
                index,
                state,
                retry_after_ns,
            },
            Taken::TooLarge => Verdict::TooLarge { index },
        };
        for taken in &charges[..index] {
            table.refund(taken.key, taken.quota, taken.n, now_ns);
        }
        return refused;
    }
    Verdict::Allowed(states)
}

/// Charges every charge to `table` at `now_ns`, room or not (output
/// tokens).
pub fn charge(table: &LimitTable<'_>, charges: &[Charge], now_ns: u64) {
    for c in charges.iter().filter(|c| c.n > 0) {
        table.charge(c.key, c.quota, c.n, now_ns);
    }
}

/// Gives every charge back to `table` at `now_ns` (a reservation not
/// used).
pub fn refund(table: &LimitTable<'_>, charges: &[Charge], now_ns: u64) {
    for c in charges.iter().filter(|c| c.n > 0) {
        table.refund(c.key, c.quota, c.n, now_ns);
    }
}

/// The buckets one request is charged to: its tenant's, then its
/// model's.
#[derive(Debug, Clone, Default)]
pub struct RequestBuckets {
    buckets: Vec<Bucket>,
}

impl RequestBuckets {
    /// `tenant`'s buckets, then `model`'s.
    pub fn new(tenant: &[Bucket], model: &[Bucket]) -> Self {
        Self {
            buckets: tenant.iter().chain(model).cloned().collect(),
        }
    }

    /// Whether there are none (nothing to check).
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    /// The charges of a request: one request, and `prompt_tokens` tokens
    /// plus `reserve` for its output (no more of it than the bucket's
    /// limit less the prompt: a prompt that fits is never refused for the
    /// output it asked for).
    pub fn admission(&self, prompt_tokens: u64, reserve: u64) -> Vec<Charge> {
        self.buckets
            .iter()
            .map(|b| {
                b.charge(match b.unit {
                    Unit::Requests => 1,
                    Unit::Tokens => {
                        prompt_tokens.saturating_add(reserve.min(b.quota.limit.saturating_sub(prompt_tokens)))
                    }
                })
            })
            .collect()
    }

    /// The buckets its output tokens go to, with what `charges` (its
    /// [`admission`](Self::admission)) reserved in each (`None` if none
    /// counts tokens).
    pub fn output(&self, charges: &[Charge], prompt_tokens: u64) -> Option<OutputBuckets> {
        let tokens: Vec<(Bucket, u64)> = self
            .buckets
            .iter()
            .zip(charges)
            .filter(|(b, _)| b.unit == Unit::Tokens)
            .map(|(b, c)| (b.clone(), c.n.saturating_sub(prompt_tokens)))
            .collect();
        (!tokens.is_empty()).then_some(OutputBuckets { buckets: tokens })
    }

    /// What `verdict` on `charges` (its [`admission`](Self::admission))
    /// means for the client.
    pub fn outcome(&self, verdict: &Verdict, charges: &[Charge]) -> Outcome {
        match verdict {
            Verdict::Allowed(states) => {
                Outcome::Allowed(Headroom::least(self.buckets.iter().zip(states.iter().copied())))
            }
            Verdict::Limited {
                index,
                state,
                retry_after_ns,
            } => {
                let bucket = &self.buckets[*index];
                let requested = charges[*index].n;
                Outcome::Refused(Refusal {
                    message: format!(
                        "Rate limit reached for {}, Remaining {}, Requested {requested}. Please try again in {}.",
                        bucket.described(),
                        state.remaining,
                        duration_text(*retry_after_ns)
                    ),
                    unit: bucket.unit,
                    retry_after_ns: Some(*retry_after_ns),
                    headroom: Headroom::least(std::iter::once((bucket, *state))),
                })
            }
            Verdict::TooLarge { index } => {
                let bucket = &self.buckets[*index];
                let requested = charges[*index].n;
                Outcome::Refused(Refusal {
                    message: format!(
                        "Request too large for {}, Requested {requested}. The input must be smaller.",
                        bucket.described()
                    ),
                    unit: bucket.unit,
                    retry_after_ns: None,
                    headroom: Headroom::default(),
                })
            }
        }
    }
}

/// The token buckets an answer's output is charged to, each with the
/// output reserved in it when the request was let in.
#[derive(Debug, Clone)]
pub struct OutputBuckets {
    buckets: Vec<(Bucket, u64)>,
}

/// What settling a reservation does: charges beyond it (room or not) and
/// refunds of what it did not use.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settlement {
    /// Output beyond the reservation, charged room or not.
    pub charge: Vec<Charge>,
    /// The unused part of the reservation, given back.
    pub refund: Vec<Charge>,
}

impl OutputBuckets {
    /// The settlement of an answer of `tokens` output tokens against the
    /// reservations.
    pub fn settle(&self, tokens: u64) -> Settlement {
        let mut s = Settlement::default();
        for (bucket, reserved) in &self.buckets {
            if tokens > *reserved {
                s.charge.push(bucket.charge(tokens - reserved));
            } else if tokens < *reserved {
                s.refund.push(bucket.charge(reserved - tokens));
            }
        }
        s
    }

    /// The output reserved in its buckets (the largest).
    pub fn reserved(&self) -> u64 {
        self.buckets.iter().map(|(_, r)| *r).max().unwrap_or(0)
    }
}

/// A request let in or not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Let in; the headers its answer carries.
    Allowed(Headroom),
    /// Refused (429).
    Refused(Refusal),
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The error message.
    pub message: String,
    /// The unit that refused it (the error's `type`).
    pub unit: Unit,
    /// When to try again (`None`: never, as it is).
    pub retry_after_ns: Option<u64>,
    /// The headers of the bucket that refused it.
    pub headroom: Headroom,
}

impl Refusal {
    /// `Retry-After` and `retry-after-ms` (when it may be tried again),
    /// and the bucket's headers.
    pub fn set_headers(&self, headers: &mut HeaderMap) {
        if let Some(ns) = self.retry_after_ns {
            let ms = ns.div_ceil(1_000_000);
            insert(headers, "retry-after", &ms.div_ceil(1000).max(1).to_string());
            insert(headers, "retry-after-ms", &ms.to_string());
        }
        self.headroom.set_headers(headers);
    }
}

/// The room left in the fullest bucket of each unit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Headroom {
    /// Requests: (limit, bucket).
    pub requests: Option<(u64, BucketState)>,
    /// Tokens: (limit, bucket).
    pub tokens: Option<(u64, BucketState)>,
}

impl Headroom {
    /// Of each unit, the bucket with the least room.
    fn least<'a>(states: impl Iterator<Item = (&'a Bucket, BucketState)>) -> Self {
        let mut h = Self::default();
        for (bucket, state) in states {
            let slot = match bucket.unit {
                Unit::Requests => &mut h.requests,
                Unit::Tokens => &mut h.tokens,
            };
            if slot.is_none_or(|(_, s)| state.remaining < s.remaining) {
                *slot = Some((bucket.quota.limit, state));
            }
        }
        h
    }

    /// OpenAI's `x-ratelimit-*` headers.
    pub fn set_headers(&self, headers: &mut HeaderMap) {
        for (unit, figures) in [(Unit::Requests, self.requests), (Unit::Tokens, self.tokens)] {
            let Some((limit, state)) = figures else { continue };
            let name = unit.name();
            insert(headers, &format!("x-ratelimit-limit-{name}"), &limit.to_string());
            insert(
                headers,
                &format!("x-ratelimit-remaining-{name}"),
                &state.remaining.to_string(),
            );
            insert(
                headers,
                &format!("x-ratelimit-reset-{name}"),
                &duration_text(state.reset_ns),
            );
        }
    }
}

fn insert(headers: &mut HeaderMap, name: &str, value: &str) {
    if let (Ok(name), Ok(value)) = (
        http::HeaderName::from_bytes(name.as_bytes()),
        HeaderValue::from_str(value),
    ) {
        headers.insert(name, value);
    }
}

/// A duration as OpenAI's rate-limit headers write it: `20ms` under a
/// second, else hours, minutes and seconds (`1s`, `1.5s`, `6m0s`,
/// `1h0m0s`), to the millisecond.
pub fn duration_text(ns: u64) -> String {
    let ms = ns.div_ceil(1_000_000);
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (h, m, s, frac) = (ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000);
    let seconds = if frac == 0 {
        format!("{s}s")
    } else {
        let f = format!("{frac:03}");
        format!("{s}.{}s", f.trim_end_matches('0'))
    };
    match (h, m) {
        (0, 0) => seconds,
        (0, m) => format!("{m}m{seconds}"),
        (h, m) => format!("{h}h{m}m{seconds}"),
    }
}

/// The output a request reserves: what it asked for of each answer
/// (`max_tokens`, else `default`), at most the room `context_room` left in
/// the largest live engine's context when that is known, times the
/// answers it asked for.
pub fn output_reservation(asked: Option<u64>, answers: u64, default: u64, context_room: Option<u64>) -> u64 {
    let each = asked.unwrap_or(default);
    let each = context_room.map_or(each, |room| each.min(room));
    each.saturating_mul(answers.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use shm_layout::{LayoutPlan, Segment};

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn durations_are_written_as_openai_writes_them() {
        for (ns, text) in [
            (0, "0ms"),
            (20 * 1_000_000, "20ms"),
            (1_000_000_001, "1.001s"),
            (SEC, "1s"),
            (1_500_000_000, "1.5s"),
            (360 * SEC, "6m0s"),
            (3_600 * SEC, "1h0m0s"),
            (3_723 * SEC + 40_000_000, "1h2m3.04s"),
        ] {
            assert_eq!(duration_text(ns), text, "{ns}");
        }
    }

    #[test]
    fn a_request_is_let_in_by_all_its_buckets_or_costs_none_of_them() {
        let segment = Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap());
        let tables = segment.tables();
        let t = tables.limits;
        let tenant = RateLimits {
            requests_per_minute: Some(10),
            tokens_per_minute: Some(1000),
        }
        .buckets(Scope::Tenant, "acme");
        let model = RateLimits {
            requests_per_minute: None,
            tokens_per_minute: Some(500),
        }
        .buckets(Scope::Model, "big");
        let request = RequestBuckets::new(&tenant, &model);
        let now = 100 * SEC;
        let charges = request.admission(300, 0);
        let v = take(&t, &charges, now);
        let Outcome::Allowed(h) = request.outcome(&v, &charges) else {
            panic!("{v:?}")
        };
        assert_eq!(h.requests.map(|(l, s)| (l, s.remaining)), Some((10, 9)));
        // Of the two token buckets, the model's has less room.
        assert_eq!(h.tokens.map(|(l, s)| (l, s.remaining)), Some((500, 200)));
        // 300 more: the model's bucket refuses, and the tenant's request
        // and tokens are given back.
        let v = take(&t, &charges, now);
        let Outcome::Refused(r) = request.outcome(&v, &charges) else {
            panic!("{v:?}")
        };
        assert_eq!(r.unit, Unit::Tokens);
        assert!(
            r.message.contains("model 'big'") && r.message.contains("Limit 500"),
            "{}",
            r.message
        );
        assert_eq!(r.retry_after_ns, Some(12 * SEC));
        assert_eq!(
            r.message,
            "Rate limit reached for model 'big' on tokens per min (TPM): Limit 500, Remaining 200, Requested 300. \
             Please try again in 12s."
        );
        assert_eq!(t.peek(tenant[0].key, tenant[0].quota, now).remaining, 9);
        assert_eq!(t.peek(tenant[1].key, tenant[1].quota, now).remaining, 700);
        let mut headers = HeaderMap::new();
        r.set_headers(&mut headers);
        assert_eq!(headers["retry-after"], "12");
        assert_eq!(headers["retry-after-ms"], "12000");
        assert_eq!(headers["x-ratelimit-limit-tokens"], "500");
        assert_eq!(headers["x-ratelimit-remaining-tokens"], "200");
        // Never fits: too large, no retry.
        let charges = request.admission(600, 0);
        let v = take(&t, &charges, now);
        let Outcome::Refused(r) = request.outcome(&v, &charges) else {
            panic!("{v:?}")
        };
        assert_eq!(r.retry_after_ns, None);
        assert_eq!(
            r.message,
            "Request too large for model 'big' on tokens per min (TPM): Limit 500, Requested 600. The input must be \
             smaller."
        );
        assert!(
            r.message.starts_with("Request too large for model 'big'"),
            "{}",
            r.message
        );
        // Output tokens beyond the reservation (none here) go into debt.
        let out = request.output(&request.admission(300, 0), 300).unwrap();
        let settled = out.settle(400);
        assert!(settled.refund.is_empty());
        charge(&t, &settled.charge, now);
        assert_eq!(t.peek(model[0].key, model[0].quota, now).remaining, 0);
        assert_eq!(t.peek(tenant[1].key, tenant[1].quota, now).remaining, 300);
    }

    #[test]
    fn output_is_reserved_at_admission_and_settled_at_the_end() {
        let segment = Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap());
        let t = segment.tables().limits;
        let tenant = RateLimits {
            requests_per_minute: None,
            tokens_per_minute: Some(10_000),
        }
        .buckets(Scope::Tenant, "acme");
        let request = RequestBuckets::new(&tenant, &[]);
        let now = 100 * SEC;
        // 100 prompt tokens and 4 answers of up to 1 000: 4 100 taken.
        let charges = request.admission(100, output_reservation(Some(1000), 4, 4096, None));
        assert_eq!(charges[0].n, 4100);
        assert!(matches!(take(&t, &charges, now), Verdict::Allowed(_)));
        assert_eq!(t.peek(tenant[0].key, tenant[0].quota, now).remaining, 5900);
        // Two such requests fit, not a third.
        assert!(matches!(take(&t, &charges, now), Verdict::Allowed(_)));
        assert!(matches!(take(&t, &charges, now), Verdict::Limited { .. }));
        // The first answers 500 tokens: 3 500 come back.
        let out = request.output(&charges, 100).unwrap();
        assert_eq!(out.reserved(), 4000);
        let settled = out.settle(500);
        assert!(settled.charge.is_empty());
        refund(&t, &settled.refund, now);
        assert_eq!(t.peek(tenant[0].key, tenant[0].quota, now).remaining, 5300);
        // The second answers 4 500 (more than it reserved): 500 charged.
        let settled = out.settle(4500);
        assert!(settled.refund.is_empty() && settled.charge[0].n == 500);
        charge(&t, &settled.charge, now);
        assert_eq!(t.peek(tenant[0].key, tenant[0].quota, now).remaining, 4800);
        // A reservation never makes a prompt that fits too large: it is
        // cut to the limit less the prompt.
        let charges = request.admission(9_000, 8192);
        assert_eq!(charges[0].n, 10_000);
        // The context bounds what is reserved, per answer.
        assert_eq!(output_reservation(Some(8192), 2, 4096, Some(1000)), 2000);
        assert_eq!(output_reservation(None, 1, 4096, Some(100_000)), 4096);
        assert_eq!(output_reservation(None, 1, 4096, None), 4096);
        assert_eq!(output_reservation(Some(u64::MAX), u64::MAX, 1, None), u64::MAX);
    }

    #[test]
    fn buckets_are_apart_by_scope_unit_and_name_and_limits_are_checked() {
        let both = RateLimits {
            requests_per_minute: Some(1),
            tokens_per_minute: Some(1),
        };
        let keys: std::collections::HashSet<u64> = [
            both.buckets(Scope::Tenant, "a"),
            both.buckets(Scope::Model, "a"),
            both.buckets(Scope::Tenant, "b"),
        ]
        .concat()
        .iter()
        .map(|b| b.key)
        .collect();
        assert_eq!(keys.len(), 6);
        assert!(RateLimits::default().buckets(Scope::Tenant, "a").is_empty());
        let zero = RateLimits {
            requests_per_minute: Some(0),
            tokens_per_minute: None,
        };
        assert_eq!(zero.check(), Err("requests_per_minute"));
        assert!(both.check().is_ok());
    }
}
