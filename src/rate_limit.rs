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
//! tokens when the request is let in (after tokenization, before routing)
//! and output tokens when its answer ends: the engine's reported
//! `usage.completion_tokens`, else a quarter of the answer's bytes (an
//! answer cut short by its client is charged for what was relayed). A
//! request is let in only when **every** bucket it is charged to has room
//! ([`take`]: the units taken from the earlier buckets are given back when
//! a later one refuses), so a refused request costs nothing. Output tokens
//! are charged whether or not there is room (the answer was given): the
//! bucket goes into debt, at most one period deep, and the next requests
//! wait it out. Other `/v1/...` requests naming a model (embeddings, ...)
//! are charged one request and no tokens. An answer from the response
//! cache counts as a request with its prompt tokens (the check comes
//! before the cache is read), and no output tokens.
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

    /// The charges of a request: one request and `prompt_tokens` tokens.
    pub fn admission(&self, prompt_tokens: u64) -> Vec<Charge> {
        self.buckets
            .iter()
            .map(|b| {
                b.charge(match b.unit {
                    Unit::Requests => 1,
                    Unit::Tokens => prompt_tokens,
                })
            })
            .collect()
    }

    /// The buckets its output tokens go to (`None` if none counts tokens).
    pub fn output(&self) -> Option<OutputBuckets> {
        let tokens: Vec<Bucket> = self
            .buckets
            .iter()
            .filter(|b| b.unit == Unit::Tokens)
            .cloned()
            .collect();
        (!tokens.is_empty()).then_some(OutputBuckets { buckets: tokens })
    }

    /// What `verdict` on [`admission`](Self::admission)`(prompt_tokens)`
    /// means for the client.
    pub fn outcome(&self, verdict: &Verdict, prompt_tokens: u64) -> Outcome {
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
                let requested = match bucket.unit {
                    Unit::Requests => 1,
                    Unit::Tokens => prompt_tokens,
                };
                Outcome::Refused(Refusal {
                    message: format!(
                        "Rate limit reached for {} '{}' on {} per min ({}): Limit {}, Remaining {}, Requested {requested}. Please try again in {}.",
                        bucket.scope.name(),
                        bucket.owner,
                        bucket.unit.name(),
                        bucket.unit.short(),
                        bucket.quota.limit,
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
                Outcome::Refused(Refusal {
                    message: format!(
                        "Request too large for {} '{}' on {} per min ({}): Limit {}, Requested {prompt_tokens}. The input must be smaller.",
                        bucket.scope.name(),
                        bucket.owner,
                        bucket.unit.name(),
                        bucket.unit.short(),
                        bucket.quota.limit
                    ),
                    unit: bucket.unit,
                    retry_after_ns: None,
                    headroom: Headroom::default(),
                })
            }
        }
    }
}

/// The token buckets an answer's output is charged to.
#[derive(Debug, Clone)]
pub struct OutputBuckets {
    buckets: Vec<Bucket>,
}

impl OutputBuckets {
    /// The charges of `tokens` output tokens.
    pub fn charges(&self, tokens: u64) -> Vec<Charge> {
        self.buckets.iter().map(|b| b.charge(tokens)).collect()
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

/// Output tokens an answer is charged: the engine's count when it gave
/// one, else a quarter of `bytes` of answer (rounded up).
pub fn output_tokens(reported: Option<u64>, bytes: u64) -> u64 {
    reported.unwrap_or_else(|| bytes.div_ceil(4))
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
        let v = take(&t, &request.admission(300), now);
        let Outcome::Allowed(h) = request.outcome(&v, 300) else {
            panic!("{v:?}")
        };
        assert_eq!(h.requests.map(|(l, s)| (l, s.remaining)), Some((10, 9)));
        // Of the two token buckets, the model's has less room.
        assert_eq!(h.tokens.map(|(l, s)| (l, s.remaining)), Some((500, 200)));
        // 300 more: the model's bucket refuses, and the tenant's request
        // and tokens are given back.
        let v = take(&t, &request.admission(300), now);
        let Outcome::Refused(r) = request.outcome(&v, 300) else {
            panic!("{v:?}")
        };
        assert_eq!(r.unit, Unit::Tokens);
        assert!(
            r.message.contains("model 'big'") && r.message.contains("Limit 500"),
            "{}",
            r.message
        );
        assert_eq!(r.retry_after_ns, Some(12 * SEC));
        assert_eq!(t.peek(tenant[0].key, tenant[0].quota, now).remaining, 9);
        assert_eq!(t.peek(tenant[1].key, tenant[1].quota, now).remaining, 700);
        let mut headers = HeaderMap::new();
        r.set_headers(&mut headers);
        assert_eq!(headers["retry-after"], "12");
        assert_eq!(headers["retry-after-ms"], "12000");
        assert_eq!(headers["x-ratelimit-limit-tokens"], "500");
        assert_eq!(headers["x-ratelimit-remaining-tokens"], "200");
        // Never fits: too large, no retry.
        let v = take(&t, &request.admission(600), now);
        let Outcome::Refused(r) = request.outcome(&v, 600) else {
            panic!("{v:?}")
        };
        assert_eq!(r.retry_after_ns, None);
        assert!(
            r.message.starts_with("Request too large for model 'big'"),
            "{}",
            r.message
        );
        // Output tokens go into debt.
        let out = request.output().unwrap();
        charge(&t, &out.charges(400), now);
        assert_eq!(t.peek(model[0].key, model[0].quota, now).remaining, 0);
        assert_eq!(t.peek(tenant[1].key, tenant[1].quota, now).remaining, 300);
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
        assert_eq!(output_tokens(Some(7), 1000), 7);
        assert_eq!(output_tokens(None, 9), 3);
    }
}
