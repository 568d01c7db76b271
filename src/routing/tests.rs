//! Tests of the routing module as a whole: configuration, the factory, and
//! properties every policy keeps.

use super::least_load::load_key;
use super::load_bound::LoadBound;
use super::test_support::{Fixture, cand, choice, input, input_for};
use super::*;

#[test]
fn kind_names_round_trip() {
    for k in PolicyKind::ALL {
        assert_eq!(k.to_string(), k.name());
        assert_eq!(k.name().parse::<PolicyKind>(), Ok(k));
        assert_eq!(serde_json::to_string(&k).unwrap(), format!("\"{}\"", k.name()));
        assert_eq!(serde_json::from_str::<PolicyKind>(&format!("\"{k}\"")).unwrap(), k);
    }
    assert_eq!(PolicyKind::default(), PolicyKind::CacheAware);
    let e = "cache-aware".parse::<PolicyKind>().unwrap_err().to_string();
    assert!(
        e.contains("\"cache-aware\"") && e.contains("cache_aware, least_load"),
        "{e}"
    );
}

#[test]
fn build_returns_each_kind() {
    for kind in PolicyKind::ALL {
        let p = build(&PolicyConfig {
            kind,
            ..PolicyConfig::default()
        });
        assert_eq!(p.name(), kind.name());
    }
    // The cache-aware parameters reach the policy: with threshold 0.0 a
    // one-block match of ten routes by prefix, with the default it does not.
    let f = Fixture::new(2);
    let chain = Fixture::chain(1, 10);
    f.hold(1, &chain[..1]);
    let m = f.matched(&chain);
    let cands = [cand(f.s[0], 0, 0), cand(f.s[1], 1, 0)];
    let eager = PolicyConfig {
        cache_aware: CacheAwareParams {
            cache_threshold: 0.0,
            ..CacheAwareParams::default()
        },
        ..PolicyConfig::default()
    };
    let c = build(&eager).choose(&input(10, &m, &cands)).unwrap();
    assert_eq!(c, choice(f.s[1], Reason::Prefix { blocks: 1 }));
    let c = build(&PolicyConfig::default()).choose(&input(10, &m, &cands)).unwrap();
    assert_eq!(c, choice(f.s[0], Reason::LeastLoad));
}

#[test]
fn validate_accepts_the_defaults_and_the_range_ends() {
    assert_eq!(PolicyConfig::default().validate(), Ok(()));
    for (t, rel) in [(0.0, 1.0), (1.0, 1.0), (0.3, 1.5), (1.0, 1e9)] {
        let c = PolicyConfig {
            cache_aware: CacheAwareParams {
                cache_threshold: t,
                balance_abs_threshold: 0,
                balance_rel_threshold: rel,
                scale_to_capacity: true,
                weigh_queued_prefill: true,
                queued_prefill_margin: crate::routing::cache_aware::QUEUED_PREFILL_MARGIN,
                saved_tokens_per_spread: 0,
                fallback_weighs_own_prefill: false,
            },
            ..PolicyConfig::default()
        };
        assert_eq!(c.validate(), Ok(()), "{t} {rel}");
    }
}

#[test]
fn validate_errors_name_field_value_and_reason() {
    let with = |cache_threshold, balance_rel_threshold| PolicyConfig {
        kind: PolicyKind::RoundRobin, // validated whatever the kind
        cache_aware: CacheAwareParams {
            cache_threshold,
            balance_rel_threshold,
            ..CacheAwareParams::default()
        },
        ..PolicyConfig::default()
    };
    for (t, shown) in [(1.5, "1.5"), (-0.1, "-0.1"), (f64::NAN, "NaN")] {
        let e = with(t, 1.1).validate().unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("cache_aware.cache_threshold = {shown}: ")),
            "{e}"
        );
        assert!(e.contains("between 0.0 and 1.0"), "{e}");
    }
    for (rel, shown) in [(0.99, "0.99"), (0.0, "0"), (f64::INFINITY, "inf"), (f64::NAN, "NaN")] {
        let e = with(0.5, rel).validate().unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("cache_aware.balance_rel_threshold = {shown}: ")),
            "{e}"
        );
        assert!(e.contains(">= 1.0"), "{e}");
    }
}

#[test]
fn config_deserializes_with_defaults() {
    let c: PolicyConfig = serde_json::from_str("{}").unwrap();
    assert_eq!(c, PolicyConfig::default());
    let c: PolicyConfig = serde_json::from_str(r#"{"kind": "least_load"}"#).unwrap();
    assert_eq!(
        c,
        PolicyConfig {
            kind: PolicyKind::LeastLoad,
            ..PolicyConfig::default()
        }
    );
    let c: PolicyConfig =
        serde_json::from_str(r#"{"cache_aware": {"cache_threshold": 0.4, "balance_abs_threshold": 64}}"#).unwrap();
    assert_eq!(c.kind, PolicyKind::CacheAware);
    assert_eq!(
        c.cache_aware,
        CacheAwareParams {
            cache_threshold: 0.4,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.1,
            scale_to_capacity: true,
            weigh_queued_prefill: true,
            queued_prefill_margin: crate::routing::cache_aware::QUEUED_PREFILL_MARGIN,
            saved_tokens_per_spread: crate::routing::cache_aware::SAVED_TOKENS_PER_SPREAD,
            fallback_weighs_own_prefill: true,
        }
    );
    // Integers are accepted for the float fields.
    let c: PolicyConfig = serde_json::from_str(r#"{"cache_aware": {"balance_rel_threshold": 2}}"#).unwrap();
    assert_eq!(c.cache_aware.balance_rel_threshold, 2.0);
    // And it serializes back to the same.
    let back: PolicyConfig = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
    assert_eq!(back, c);
}

#[test]
fn config_rejects_unknown_fields_and_kinds() {
    for (json, needle) in [
        (r#"{"policy": "random"}"#, "policy"),
        (r#"{"cache_aware": {"threshold": 0.5}}"#, "threshold"),
        (r#"{"kind": "power_of_two"}"#, "power_of_two"),
        (r#"{"cache_aware": {"balance_abs_threshold": -1}}"#, "-1"),
    ] {
        let e = serde_json::from_str::<PolicyConfig>(json).unwrap_err().to_string();
        assert!(e.contains(needle), "{json}: {e}");
    }
}

/// SplitMix64, for generating test cases.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Every policy, on random servers, loads and prefix holdings: it chooses
/// a candidate (never a server outside the list, never `None` unless the
/// list is empty), and its reason is true of the choice.
#[test]
fn choices_always_come_from_the_candidates_and_reasons_hold() {
    const SERVERS: usize = 10;
    let f = Fixture::new(SERVERS);
    let mut g = Gen(0x5eed);
    let tight = CacheAwareParams {
        cache_threshold: 0.2,
        balance_abs_threshold: 3,
        balance_rel_threshold: 1.2,
        scale_to_capacity: true,
        weigh_queued_prefill: true,
        queued_prefill_margin: crate::routing::cache_aware::QUEUED_PREFILL_MARGIN,
        saved_tokens_per_spread: 0,
        fallback_weighs_own_prefill: false,
    };
    let policies: Vec<(Box<dyn Policy>, Option<CacheAwareParams>)> = vec![
        (
            Box::new(cache_aware::CacheAware::default()),
            Some(CacheAwareParams::default()),
        ),
        (Box::new(cache_aware::CacheAware::new(tight)), Some(tight)),
        (Box::new(least_load::LeastLoad::new()), None),
        (Box::new(round_robin::RoundRobin::new()), None),
        (Box::new(random::Random::with_seed(7)), None),
        (Box::new(selective_push::SelectivePush::new(Default::default())), None),
        (Box::new(consistent_hash::ConsistentHash::new(Default::default())), None),
        (Box::new(dual_map::DualMap::new(Default::default())), None),
        (
            Box::new(weighted_scorers::WeightedScorers::with_seed(Default::default(), 3)),
            None,
        ),
        (
            Box::new(cost::Cost::new(CostParams {
                initial_weight: 1.0,
                tune: false,
                ..CostParams::default()
            })),
            None,
        ),
    ];
    let mut prefix_choices = 0;
    for round in 0..3000u64 {
        let prompt_blocks = g.below(17) as usize;
        let chain = Fixture::chain(round + 1000, prompt_blocks.max(1));
        // Up to 5 servers hold some leading part of the chain.
        for _ in 0..g.below(6) {
            let depth = 1 + g.below(chain.len() as u64) as usize;
            f.hold(g.below(SERVERS as u64) as usize, &chain[..depth]);
        }
        let m = f.matched(&chain);
        // A random subset of the servers (possibly none) are candidates;
        // loads are small so that ties and both balance regimes occur.
        let mut candidates = Vec::new();
        for s in &f.s {
            if g.below(3) != 0 {
                // Engines that run 16 at once: none is full.
                let c = cand(*s, g.below(12), g.below(3) * 100);
                candidates.push(Candidate { admission: 16, ..c });
            }
        }
        let min_key = candidates.iter().map(load_key).min();
        let least = balance::least_busy(&candidates);
        let mut route = input_for(&chain[..prompt_blocks], prompt_blocks as u32 * 16, &m, &candidates);
        // A third of the prompts open with a shared header.
        if g.below(3) == 0 {
            route.header_blocks = g.below(prompt_blocks as u64 + 1) as u32;
        }
        let header = route.header_blocks;
        let useful = |c: &Candidate| Some(m.blocks_for(c.server.tag())).filter(|b| *b > header).unwrap_or(0);
        for (p, params) in &policies {
            let Some(choice) = p.choose(&route) else {
                assert!(candidates.is_empty(), "{} chose nothing", p.name());
                continue;
            };
            let Some(chosen) = candidates.iter().find(|c| c.server == choice.server) else {
                panic!("{} chose {:?}, not a candidate", p.name(), choice.server);
            };
            match choice.reason {
                Reason::SameEngine => panic!("{} chose by the resumption's reason", p.name()),
                Reason::Prefix { blocks } => {
                    prefix_choices += 1;
                    assert!(blocks > header && blocks == m.blocks_for(chosen.server.tag()));
                    // No candidate holds more past the header (no
                    // candidate is full here); for the policies that skip
                    // overloaded servers for the prefix, no other such one.
                    let rival = |c: &&Candidate| params.is_some() || !balance::Balance::DEFAULT.overloaded(c, least);
                    assert!(candidates.iter().filter(rival).all(|c| useful(c) <= blocks));
                    match params {
                        Some(params) => {
                            assert!(f64::from(blocks) > params.cache_threshold * prompt_blocks as f64);
                            let own = u64::from(blocks - header) * 16;
                            assert!(!params.winner_overloaded(chosen, &candidates, own));
                        }
                        None => assert!(
                            ["selective_push", "dual_map"].contains(&p.name()),
                            "{} routed by prefix",
                            p.name()
                        ),
                    }
                }
                Reason::LeastLoad => assert_eq!(Some(load_key(chosen)), min_key, "{}", p.name()),
                Reason::RoundRobin => assert_eq!(p.name(), "round_robin"),
                Reason::Random => assert_eq!(p.name(), "random"),
                Reason::StoredResponse => panic!("{}: only the dispatcher pins to a stored response", p.name()),
                Reason::Session => {
                    assert_eq!(p.name(), "consistent_hash");
                    // Where the session's cache is, when some server
                    // under the load bound holds any of it past the header.
                    let bound = LoadBound::over(&candidates, ConsistentHashParams::default().load_epsilon);
                    let best = candidates
                        .iter()
                        .filter(|c| bound.admits(c))
                        .map(useful)
                        .max()
                        .unwrap_or(0);
                    if best > 0 {
                        assert_eq!(useful(chosen), best);
                    }
                }
                Reason::HashCandidate { candidate, blocks } => {
                    assert_eq!(p.name(), "dual_map");
                    assert!(candidate == 1 || candidate == 2);
                    assert_eq!(blocks, useful(chosen));
                }
                Reason::Slo | Reason::Rebalanced => assert_eq!(p.name(), "dual_map"),
                Reason::Scored { permille } => {
                    assert_eq!(p.name(), "weighted_scorers");
                    assert!(permille <= 1000);
                }
                Reason::Cost { arm } => {
                    assert_eq!((p.name(), arm), ("cost", None));
                    // Weight 1, nothing pending or queued: every request in
                    // flight is decoding, 16 tokens of work each; the
                    // cheapest of the servers under the load bound.
                    let cost = |c: &Candidate| {
                        let cached = useful(c).min(prompt_blocks as u32);
                        u64::from(prompt_blocks as u32 - cached) * 16 + c.inflight * 16
                    };
                    let bound = LoadBound::over(&candidates, CostParams::default().load_epsilon);
                    assert!(bound.admits(chosen));
                    let under = candidates.iter().filter(|c| bound.admits(c));
                    assert_eq!(Some(cost(chosen)), under.map(cost).min());
                }
            }
        }
    }
    assert!(
        prefix_choices > 500,
        "prefix routing exercised only {prefix_choices} times"
    );
}

/// Servers of weights 1, 2 and 1 (`[[backend]] weight`), new prompts that
/// no server holds arriving while none ends: every policy that balances
/// by load or in turn gives the server of weight 2 about twice the
/// requests of each other, and the least-load rule exactly its share.
/// `consistent_hash` and `dual_map` take their servers from hash rings
/// whose arcs are not weighted (a key keeps its place on the ring); only
/// their load rules are, so the heavier server takes more, not twice.
#[test]
fn every_balancing_policy_shares_requests_by_weight() {
    let f = Fixture::new(3);
    let weights = [1u32, 2, 1];
    let policies: Vec<Box<dyn Policy>> = vec![
        Box::new(cache_aware::CacheAware::default()),
        Box::new(least_load::LeastLoad::new()),
        Box::new(round_robin::RoundRobin::new()),
        Box::new(random::Random::with_seed(11)),
        Box::new(selective_push::SelectivePush::new(Default::default())),
        Box::new(consistent_hash::ConsistentHash::new(Default::default())),
        Box::new(dual_map::DualMap::new(Default::default())),
        Box::new(weighted_scorers::WeightedScorers::with_seed(Default::default(), 5)),
        Box::new(cost::Cost::new(CostParams {
            initial_weight: 1.0,
            tune: false,
            ..CostParams::default()
        })),
    ];
    for p in &policies {
        let mut inflight = [0u64; 3];
        // Random and the hash rings are sampled: more draws.
        let requests = if matches!(p.name(), "random") { 4000 } else { 400 };
        for r in 0..requests {
            let chain = Fixture::chain(r + 50_000, 4);
            let m = f.matched(&chain);
            let candidates: Vec<Candidate> = (0..3)
                .map(|i| Candidate {
                    admission: 1 << 20,
                    weight: weights[i],
                    ..cand(f.s[i], inflight[i], 0)
                })
                .collect();
            let mut route = input_for(&chain, 64, &m, &candidates);
            route.session = Some(r);
            let choice = p.choose(&route).expect("a choice");
            let i = f.s.iter().position(|s| *s == choice.server).expect("a candidate");
            inflight[i] += 1;
        }
        let share = inflight[1] as f64 / (inflight[0] + inflight[2]) as f64;
        let ringed = matches!(p.name(), "consistent_hash" | "dual_map");
        let expected = if ringed { 0.6..=1.1 } else { 0.9..=1.1 };
        assert!(
            expected.contains(&share),
            "{}: the server of weight 2 took {} against {} and {}",
            p.name(),
            inflight[1],
            inflight[0],
            inflight[2]
        );
        if matches!(p.name(), "least_load" | "round_robin") {
            assert_eq!(inflight, [100, 200, 100], "{}", p.name());
        }
    }
}

#[test]
fn by_weight_gives_each_candidate_its_weight_in_draws() {
    let f = Fixture::new(3);
    let cands: Vec<Candidate> = [1u32, 3, 2]
        .iter()
        .enumerate()
        .map(|(i, w)| Candidate {
            weight: *w,
            ..cand(f.s[i], 0, 0)
        })
        .collect();
    assert_eq!(total_weight(&cands), 6);
    let drawn: Vec<usize> = (0..6)
        .map(|d| {
            f.s.iter()
                .position(|s| *s == by_weight(&cands, d).unwrap().server)
                .unwrap()
        })
        .collect();
    assert_eq!(drawn, [0, 1, 1, 1, 2, 2]);
    assert_eq!(by_weight(&[], 0), None);
    // Every weight 1: the draw is the index.
    let ones: Vec<Candidate> = (0..3).map(|i| cand(f.s[i], 0, 0)).collect();
    for d in 0..3 {
        assert_eq!(by_weight(&ones, d).unwrap().server, f.s[d as usize]);
    }
}
