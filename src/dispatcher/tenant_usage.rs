//! Usage per tenant and per model: what each request adds to the
//! segment's usage table ([`shm_layout::usage_table`]), which `semlb
//! status` and `/metrics` read. A request counts for its caller's tenant
//! (with `[auth]`) and for its model pool (a configured `[[model]]`; the
//! implicit pool takes any name a client sends, so it is not counted by
//! name).

use shm_layout::{UsageCounter, UsageKind};

use super::Dispatcher;

/// Adds `deltas` to `tenant`'s and `model`'s counts (either may be none).
pub(super) fn count(
    dispatcher: &Dispatcher,
    tenant: Option<&str>,
    model: Option<&str>,
    deltas: &[(UsageCounter, u64)],
) {
    let usage = dispatcher.segment().tables().usage;
    // A full table drops new names' counts; the known ones go on.
    if let Some(tenant) = tenant {
        usage.add(UsageKind::Tenant, tenant, deltas);
    }
    if let Some(model) = model {
        usage.add(UsageKind::Model, model, deltas);
    }
}
