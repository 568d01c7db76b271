//! Servers as the Redis store names them: by a stable id of their address
//! (the server table's id, [`crate::store::server_id`]), the same on every
//! gateway host, written in fields as lowercase hex.

use shm_layout::{Segment, ServerRef};

/// A server as the Redis store names it: the stable id of its address
/// (`semlb::store::server_id`), written in fields as lowercase hex.
pub type ServerId = u64;

/// The field name of server `id`.
pub(crate) fn id_field(id: ServerId) -> String {
    format!("{id:x}")
}

/// The server a field names, if it names one.
pub(crate) fn parse_id(field: &str) -> Option<ServerId> {
    (!field.is_empty() && field.len() <= 16)
        .then(|| u64::from_str_radix(field, 16).ok())
        .flatten()
}

/// `server`'s id in Redis: the id of its registration in `segment`, if
/// it is still registered (a stable id of its address, the same on every
/// host: [`crate::store::server_id`]).
pub(crate) fn registered(segment: &Segment, server: ServerRef) -> Option<ServerId> {
    let servers = segment.tables().servers;
    let id = servers.id_of(server.slot)?;
    servers
        .current(server.slot)
        .is_some_and(|(s, _)| s == server)
        .then_some(id)
}
