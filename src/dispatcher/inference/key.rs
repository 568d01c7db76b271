//! Stage 4, key: the prompt's block chain (rooted in the store's seed, a
//! tenant's salt when its prefixes are kept apart, and the model the pool
//! hashes under), the blocks of a shared chat template, and the request's
//! response-cache key with what the cache may do with it.

use http::header::{self, HeaderValue};
use shm_layout::ResponseKey;

use super::parse::Parsed;
use super::tokenize::Tokens;
use crate::dispatcher::timing::{DispatchTiming, Mark};
use crate::openai::prompt::RoutingInput;
use crate::prefix::blocks::{BlockHasher, TenantSalt};
use crate::response_cache::{self, Cacheability, Scope, Tenant};
use crate::routing::shared_header;

/// A request's keys: where its prompt sits in the prefix table, and under
/// which key its answer is cached.
pub(super) struct Keyed {
    pub hasher: BlockHasher,
    pub chain: Vec<u64>,
    /// Blocks the chat template's opening fills (the shared-header rule).
    pub template_blocks: u32,
    /// The tenant's salt when its prefixes are kept apart.
    pub salt: Option<TenantSalt>,
    pub cacheability: Cacheability,
    /// Its exact-request key (`None`: the cache is bypassed).
    pub key: Option<ResponseKey>,
}

/// Hashes the prompt's tokens (the `hash` stage of its timing) and keys
/// the request (counted in the `cache` stage, with the lookup).
pub(super) async fn key(
    super::Asked {
        dispatcher,
        caller,
        endpoint,
    }: super::Asked<'_>,
    request: &Parsed<'_>,
    tokens: &Tokens,
    timing: &mut DispatchTiming,
) -> Keyed {
    let Parsed {
        parts, parsed, pool, ..
    } = request;
    // The namespace's seed with Redis (hosts sharing it hash alike), else
    // the segment's.
    let seed = crate::store::chain_seed_or(dispatcher.store(), dispatcher.segment().header().seed[0]).await;
    // A tenant whose prefixes are kept apart roots its chains in its salt.
    let salt = caller
        .filter(|c| c.isolate_prefixes)
        .map(|c| TenantSalt::new(&c.tenant, seed));
    let mut root = BlockHasher::root_for(pool.chain_model(&parsed.model), seed);
    if let Some(salt) = &salt {
        root = BlockHasher::salted_root(root, salt);
    }
    let hasher = BlockHasher::new(root, pool.block_size());
    let mut chain = Vec::with_capacity(tokens.ids.len() / hasher.block_size() + 1);
    hasher.chain(&tokens.ids, &mut chain);
    let template_blocks = match &parsed.input {
        // Only the shared-header rule reads it: no tokenizing for nothing.
        RoutingInput::Text(text) if pool.shared_headers() && parsed.template_bytes >= hasher.block_size() => {
            let opening = pool
                .tokenization()
                .tokenizer
                .encode_salted(&text[..parsed.template_bytes], tokens.segment_salt);
            shared_header::template_blocks(&tokens.ids, &opening, hasher.block_size())
        }
        _ => 0,
    };
    timing.mark(Mark::Hash);
    let rc = &dispatcher.config().response_cache;
    let header_bytes = |name| parts.headers.get(name).map(HeaderValue::as_bytes);
    let cacheability = response_cache::cacheability(
        rc.enabled,
        rc.cache_nondeterministic,
        &parsed.body,
        header_bytes(header::CACHE_CONTROL),
    );
    let query = parts.uri.query().unwrap_or("");
    let key = (cacheability != Cacheability::Bypass).then(|| {
        let tenant = match caller {
            // Its answers are its own whatever the scope when its
            // prefixes are.
            Some(c) if c.isolate_prefixes => Tenant::named(Scope::Tenant, &c.tenant),
            Some(c) => Tenant::named(rc.scope, &c.tenant),
            None => Tenant::of(rc.scope, &parts.headers),
        };
        response_cache::key(
            &dispatcher.key_secret(seed),
            tenant,
            endpoint,
            query,
            &parts.headers,
            &parsed.body,
        )
    });
    Keyed {
        hasher,
        chain,
        template_blocks,
        salt,
        cacheability,
        key,
    }
}
