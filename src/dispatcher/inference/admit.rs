//! Stage 3, admit: a prompt no live engine's context takes gets the
//! engines' 400 here ([`crate::dispatcher::context_limit`]); the rest are
//! charged to their tenant's and pool's buckets, with a reservation for
//! their output ([`crate::dispatcher::charge`]), or refused with 429.

use http::{Response, StatusCode};

use super::tokenize::Tokens;
use crate::dispatcher::charge::{self, Admitted};
use crate::dispatcher::context_limit;
use crate::dispatcher::http::{Body, json_response};
use crate::openai::prompt::ParsedRequest;
use crate::pools::Pool;

/// Checks the prompt against the live engines' contexts and charges it.
pub(super) async fn admit(
    super::Asked {
        dispatcher,
        caller,
        endpoint,
    }: super::Asked<'_>,
    pool: &Pool,
    parsed: &ParsedRequest<'_>,
    tokens: &Tokens,
) -> Result<Admitted, Response<Body>> {
    let servers = &dispatcher.segment().tables().servers;
    if dispatcher.config().limits.check_context
        && let Err(exceeded) = context_limit::check(
            servers,
            |id| pool.members().admits(id),
            tokens.in_context,
            parsed.requested_output(),
        )
    {
        tracing::debug!(
            endpoint = endpoint.path(),
            prompt_tokens = tokens.ids.len(),
            context = exceeded.context.tokens,
            "{} refused: no live engine's context takes it",
            endpoint.path()
        );
        return Err(json_response(
            StatusCode::BAD_REQUEST,
            &exceeded.body(parsed.prompt_param()),
        ));
    }
    // Its output is reserved in its token buckets: what it asked for, at
    // most what the largest live context leaves.
    let reserve = || {
        crate::tenancy::rate_limit::output_reservation(
            parsed.requested_output(),
            parsed.answers().saturating_mul(tokens.prompts),
            dispatcher.config().limits.reserve_output_tokens,
            context_limit::largest(servers, |id| pool.members().admits(id))
                .map(|c| u64::from(c.tokens).saturating_sub(tokens.in_context)),
        )
    };
    charge::admit(dispatcher, caller, pool, tokens.charged, reserve).await
}
