//! Tenants: who a request is for and what it may take. The keys file and
//! the caller a request's key names ([`auth`]), the requests and tokens
//! per minute charged to a tenant's and a model's buckets
//! ([`rate_limit`]), and the gateway queue's order among tenants
//! ([`fair_share`]). The dispatcher's steps that apply them are in
//! `dispatcher/` (`charge`, `concurrency`, `share`, `tenant_usage`).
//!
//! | module | concern |
//! | --- | --- |
//! | [`auth`] | client authentication: the keys file of key digests, the caller (tenant, allowed models) a request's key names |
//! | [`rate_limit`] | requests and tokens per minute per tenant and per model: the buckets a request is charged to, all-or-none admission, OpenAI's `x-ratelimit-*` headers and 429 |
//! | [`fair_share`] | the gateway queue's order: priority classes with a starvation bound, and a token-weighted fair share among tenants (virtual token counters) |

pub mod auth;
pub mod fair_share;
pub mod rate_limit;
