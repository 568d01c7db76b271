//! What the operator said of a registration's engine that the request path
//! and the health checker need, whoever registered it (the configuration,
//! the admin API, discovery): whether its engine takes vLLM's
//! `cache_salt`, how its `/metrics` are read, its weight (its share of
//! the load, relative to the others'), and the ports of its KV cache
//! events on its host.
//!
//! Stored in two slot words like the other facts of a registration: the
//! settings word (`generation:32 | weight:16 | metrics:8 | cache_salt:1 |
//! set:1`) and the KV-ports word (`generation:32 | events port:16 |
//! replay port:16`), 0:
//! nothing said, which reads as the defaults), written while the slot is
//! `Configuring` by [`ServerTable::register_in`] (so no request reaches
//! the engine before its settings are known: a tenant's salt never goes
//! missing on a new engine's first requests), and changed later with
//! [`ServerTable::set_settings`] (a reload, the admin API).

use super::{ServerRef, ServerTable};

/// A registration's engine settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineSettings {
    /// Its engine takes vLLM's `cache_salt`: the requests of tenants
    /// whose prefixes are kept apart carry their salt to it.
    pub cache_salt: bool,
    /// How its `/metrics` are read: a code the gateway defines (0: tell
    /// from the metric names).
    pub metrics: u8,
    /// Its capacity relative to the other engines' (at least 1): the
    /// load-balancing rules compare loads per unit of weight, so an engine
    /// of weight 2 carries twice the requests of one of weight 1.
    pub weight: u16,
    /// The port its engine publishes its KV cache events on, on the
    /// engine's host (vLLM's `--kv-events-config` `endpoint`), if it does.
    pub kv_events_port: Option<u16>,
    /// The port of its engine's replay socket for lost events, if any.
    pub kv_replay_port: Option<u16>,
}

impl Default for EngineSettings {
    fn default() -> Self {
        Self {
            cache_salt: false,
            metrics: 0,
            weight: 1,
            kv_events_port: None,
            kv_replay_port: None,
        }
    }
}

impl EngineSettings {
    pub(super) fn pack(self) -> u32 {
        1 | (u32::from(self.cache_salt) << 1) | (u32::from(self.metrics) << 8) | (u32::from(self.weight.max(1)) << 16)
    }

    pub(super) fn pack_ports(self) -> u32 {
        (u32::from(self.kv_events_port.unwrap_or(0)) << 16) | u32::from(self.kv_replay_port.unwrap_or(0))
    }

    pub(super) fn unpack(v: u32, ports: u32) -> Self {
        let port = |p: u32| Some(p as u16).filter(|p| *p != 0);
        Self {
            cache_salt: v & 2 != 0,
            metrics: (v >> 8) as u8,
            weight: ((v >> 16) as u16).max(1),
            kv_events_port: port(ports >> 16),
            kv_replay_port: port(ports & 0xffff),
        }
    }
}

impl ServerTable<'_> {
    /// Sets `server`'s engine settings. Returns false (nothing stored) if
    /// `server` is not current.
    pub fn set_settings(&self, server: ServerRef, settings: EngineSettings) -> bool {
        self.set_reported(server, |s| &s.kv_ports, Some(settings.pack_ports()))
            && self.set_reported(server, |s| &s.settings, Some(settings.pack()))
    }

    /// `server`'s weight (1 if none was set): one word read, as routing
    /// reads it for every candidate.
    #[inline]
    pub fn weight(&self, server: ServerRef) -> u16 {
        self.reported(server, |s| &s.settings)
            .map_or(1, |v| EngineSettings::unpack(v, 0).weight)
    }

    /// Whether `server`'s engine takes vLLM's `cache_salt`: one word read,
    /// as the request path reads it.
    #[inline]
    pub fn takes_cache_salt(&self, server: ServerRef) -> bool {
        self.reported(server, |s| &s.settings)
            .is_some_and(|v| EngineSettings::unpack(v, 0).cache_salt)
    }

    /// `server`'s engine settings (the defaults if none were set, or if
    /// `server` is not current).
    #[inline]
    pub fn settings(&self, server: ServerRef) -> EngineSettings {
        let ports = self.reported(server, |s| &s.kv_ports).unwrap_or(0);
        self.reported(server, |s| &s.settings)
            .map(|v| EngineSettings::unpack(v, ports))
            .unwrap_or_default()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::tests::parts;
    use super::super::{Disaggregation, PoolTag};
    use super::*;

    #[test]
    fn settings_are_set_at_registration_and_die_with_it() {
        let (s, l) = parts();
        let t = ServerTable::new(&s, &l, 1);
        let salted = EngineSettings {
            cache_salt: true,
            metrics: 2,
            weight: 65535,
            kv_events_port: Some(5557),
            kv_replay_port: Some(65535),
        };
        let a = t
            .register_in(1, "http://a:8000", 0, Disaggregation::default(), PoolTag::NONE, salted)
            .unwrap();
        assert_eq!(t.settings(a), salted);
        assert_eq!((t.weight(a), t.takes_cache_salt(a)), (65535, true));
        let plain = EngineSettings {
            weight: 1,
            ..EngineSettings::default()
        };
        assert!(t.set_settings(a, plain));
        assert_eq!(t.settings(a), plain);
        assert!(t.set_settings(a, salted));
        assert!(t.retire(a));
        // A new registration of the slot does not inherit them.
        let again = t.register(2, "http://b:8000", 0).unwrap();
        assert_eq!(again.slot, a.slot);
        assert_eq!(t.settings(again), EngineSettings::default());
        assert_eq!((t.weight(again), t.takes_cache_salt(again)), (1, false));
        assert!(!t.set_settings(a, salted), "a stale registration is not written");
        assert_eq!(t.settings(again), EngineSettings::default());
    }
}
