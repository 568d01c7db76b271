//! A registration's part in disaggregated serving: whether its engine
//! prefills for others, decodes what others prefilled, or does both (an
//! ordinary engine), and, for SGLang's rendezvous, the port of its
//! engine's bootstrap server.
//!
//! Stored in the slot's role word like the other facts of a registration
//! (`generation:32 | value:32`, value 0: nothing said, an engine that
//! does both), as `port:16 | reserved:8 | role:8`. Written while the slot
//! is `Configuring` by [`ServerTable::register_as`], so no request sees
//! the registration without it, and changed later with
//! [`ServerTable::set_disaggregation`].

use super::{ServerRef, ServerState, ServerTable};

/// What an engine does in disaggregated serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ServerRole {
    /// Prefill and decode (an ordinary engine; vLLM's `kv_both`).
    #[default]
    Both,
    /// Prefill only: it computes prompts whose KV cache a decode engine
    /// takes over (vLLM's `kv_producer`, SGLang's `--disaggregation-mode
    /// prefill`). It gets no request of its own.
    Prefill,
    /// Decode only: it continues prompts a prefill engine computed
    /// (vLLM's `kv_consumer`, SGLang's `--disaggregation-mode decode`).
    Decode,
}

impl ServerRole {
    /// Lower-case name, as the configuration, `/admin/servers` and
    /// `semlb status` write it.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Both => "both",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }

    /// Whether it takes a request's decode (the request itself, or the
    /// decode leg of a split one).
    pub const fn decodes(self) -> bool {
        !matches!(self, Self::Prefill)
    }

    /// Whether it takes prefill legs.
    pub const fn prefills(self) -> bool {
        !matches!(self, Self::Decode)
    }

    const fn pack(self) -> u32 {
        match self {
            Self::Both => 0,
            Self::Prefill => 1,
            Self::Decode => 2,
        }
    }

    const fn unpack(v: u32) -> Self {
        match v {
            1 => Self::Prefill,
            2 => Self::Decode,
            _ => Self::Both,
        }
    }
}

/// A registration's role and its engine's bootstrap port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Disaggregation {
    /// What it does.
    pub role: ServerRole,
    /// The port of its engine's bootstrap server (SGLang's
    /// `--disaggregation-bootstrap-port`), if known.
    pub bootstrap_port: Option<u16>,
}

impl Disaggregation {
    /// An engine of `role` without a bootstrap port.
    pub const fn of(role: ServerRole) -> Self {
        Self {
            role,
            bootstrap_port: None,
        }
    }

    pub(super) fn pack(self) -> u32 {
        (u32::from(self.bootstrap_port.unwrap_or(0)) << 16) | self.role.pack()
    }

    fn unpack(v: u32) -> Self {
        Self {
            role: ServerRole::unpack(v & 0xff),
            bootstrap_port: Some((v >> 16) as u16).filter(|p| *p != 0),
        }
    }
}

impl ServerTable<'_> {
    /// Changes `server`'s role and bootstrap port. Returns false (nothing
    /// stored) if `server` is not current.
    pub fn set_disaggregation(&self, server: ServerRef, d: Disaggregation) -> bool {
        self.set_reported(server, |s| &s.role, Some(d.pack()))
    }

    /// `server`'s role and bootstrap port (an engine that does both, if
    /// nothing was said for this registration).
    #[inline]
    pub fn disaggregation(&self, server: ServerRef) -> Disaggregation {
        self.reported(server, |s| &s.role)
            .map_or_else(Disaggregation::default, Disaggregation::unpack)
    }

    /// The `Up` servers of `role`, with their ids: a few loads per slot,
    /// no copy of any address (a pool's check for prefill engines, on
    /// every request of a pool that may split).
    pub fn up_of_role(&self, role: ServerRole) -> impl Iterator<Item = (ServerRef, u64)> + '_ {
        (0..self.slots.len() as u16).filter_map(move |slot| {
            let (server, state) = self.current(slot)?;
            if state != ServerState::Up || self.role_of(server) != role {
                return None;
            }
            Some((server, self.id_of(slot)?))
        })
    }

    /// The role of the current registration of `slot` (routing reads it
    /// for every candidate: one load and no check of the registration,
    /// which the candidate's own reads make).
    #[inline]
    pub fn role_of(&self, server: ServerRef) -> ServerRole {
        self.disaggregation(server).role
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::tests::parts;
    use super::*;

    #[test]
    fn a_role_belongs_to_its_registration() {
        let (s, l) = parts();
        let t = ServerTable::new(&s, &l, 1);
        let p = Disaggregation {
            role: ServerRole::Prefill,
            bootstrap_port: Some(8998),
        };
        let a = t.register_as(1, "http://p:8000", 0, p).unwrap();
        assert_eq!(t.disaggregation(a), p);
        assert_eq!(t.get(a.slot).unwrap().disaggregation, p);
        let b = t.register(2, "http://b:8000", 0).unwrap();
        assert_eq!(t.disaggregation(b), Disaggregation::default());
        assert_eq!(t.role_of(b), ServerRole::Both);
        assert!(t.set_disaggregation(b, Disaggregation::of(ServerRole::Decode)));
        assert_eq!(t.role_of(b), ServerRole::Decode);
        assert_eq!(t.up_of_role(ServerRole::Prefill).collect::<Vec<_>>(), [(a, 1)]);
        assert_eq!(t.up_of_role(ServerRole::Decode).collect::<Vec<_>>(), [(b, 2)]);
        assert!(t.set_state(a, ServerState::Down));
        assert_eq!(t.up_of_role(ServerRole::Prefill).count(), 0);
        // Gone with its registration: the slot's next one does both.
        assert!(t.retire(a));
        assert!(!t.set_disaggregation(a, Disaggregation::of(ServerRole::Decode)));
        let c = t.register(3, "http://c:8000", 0).unwrap();
        assert_eq!(c.slot, a.slot);
        assert_eq!(t.disaggregation(c), Disaggregation::default());
    }

    #[test]
    fn roles_and_ports_pack_and_unpack() {
        for role in [ServerRole::Both, ServerRole::Prefill, ServerRole::Decode] {
            for bootstrap_port in [None, Some(1), Some(8998), Some(u16::MAX)] {
                let d = Disaggregation { role, bootstrap_port };
                assert_eq!(Disaggregation::unpack(d.pack()), d);
            }
        }
        assert!(ServerRole::Both.prefills() && ServerRole::Both.decodes());
        assert!(ServerRole::Prefill.prefills() && !ServerRole::Prefill.decodes());
        assert!(!ServerRole::Decode.prefills() && ServerRole::Decode.decodes());
    }
}
