//! SIGKILL inside the in-flight accounting's window.
//!
//! A request's step (begin, first token, end) changes a server's global
//! counters and then the dispatcher's own ledger cell; a process killed
//! between the two used to leave a count behind for good. This test kills a
//! real process with a real SIGKILL, hundreds of times, while it does
//! nothing but those steps in a tight loop (so most kills land inside an
//! update), reclaims it as the supervisor does, and checks after **every**
//! kill that the counters hold exactly what the surviving process (this one)
//! has in flight. It runs until 20 kills have landed between a global
//! update and its cell (what [`shm_layout::Reclaimed::interrupted`]
//! reports), or 600 kills; at least one must have, or the test did not test
//! the window.
//!
//! The child is this test binary re-executed with `SEMLB_INFLIGHT_KILL_CHILD`
//! naming the segment ([`inflight_kill_child`] returns at once otherwise).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use semlb_test_support as support;
use shm_layout::{Segment, ServerRef};

const CHILD_ENV: &str = "SEMLB_INFLIGHT_KILL_CHILD";
/// The killed process's registry slot (its ledger row); this test's own is 2.
const VICTIM: u16 = 1;
const SURVIVOR: u16 = 2;

/// Child entry point: begins, starts and ends requests to the two servers,
/// forever, until killed.
#[test]
fn inflight_kill_child() {
    let Ok(name) = std::env::var(CHILD_ENV) else {
        return;
    };
    let seg = Segment::open(&name).expect("open");
    let t = seg.tables();
    let servers: Vec<ServerRef> = (0..2).map(|i| t.servers.current(i).expect("registered").0).collect();
    println!("ready");
    std::io::stdout().flush().unwrap();
    let mut held: Vec<(ServerRef, u64, bool)> = Vec::new();
    for n in 0u64.. {
        let s = servers[(n % 2) as usize];
        let tokens = 1 + n % 997;
        assert!(t.servers.begin_request(VICTIM, s, tokens));
        // Keep a few requests in flight, some started, so a kill also
        // finds counts in the ledger outside the window.
        if n % 5 != 4 {
            t.servers.first_token(VICTIM, s, tokens);
        }
        held.push((s, tokens, n % 5 != 4));
        if held.len() > 3 {
            let (s, tokens, started) = held.remove(0);
            t.servers.end_request(VICTIM, s, tokens, started);
        }
    }
}

#[test]
fn a_kill_inside_an_inflight_update_loses_no_count() {
    let bench = support::segment::BenchSegment::create("inflight-kill", 16 << 20);
    let name = bench.segment.name().expect("a named segment").to_owned();
    let t = bench.segment.tables();
    let servers: Vec<ServerRef> = (0..2)
        .map(|i| {
            t.servers
                .register(i, &format!("http://127.0.0.1:{}", 9000 + i), 0)
                .unwrap()
        })
        .collect();
    // The survivor's own requests: what must be left after each reclaim.
    assert!(t.servers.begin_request(SURVIVOR, servers[0], 4000));
    assert!(t.servers.begin_request(SURVIVOR, servers[1], 300));
    t.servers.first_token(SURVIVOR, servers[1], 300);
    let expected = [((1, 4000), (1, 4000)), ((1, 300), (0, 0))];

    let exe = std::env::current_exe().unwrap();
    let mut rng = support::Rng::from_seed(0x1f1f_2026);
    let (mut kills, mut interrupted) = (0u32, 0u32);
    while kills < 600 && interrupted < 20 {
        let mut child = Command::new(&exe)
            .args(["--exact", "inflight_kill_child", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, &name)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the child");
        let mut ready = String::new();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        while !ready.trim_end().ends_with("ready") {
            ready.clear();
            assert_ne!(
                out.read_line(&mut ready).unwrap(),
                0,
                "the child ended before it was ready"
            );
        }
        // A random instant of its loop (the choice of instant, not a wait
        // for anything).
        std::thread::sleep(Duration::from_micros(rng.below(3000)));
        kill(Pid::from_raw(child.id() as i32), Signal::SIGKILL).unwrap();
        let status = child.wait().unwrap();
        assert!(!status.success(), "the child ended by itself: {status}");
        kills += 1;
        let r = t.servers.reclaim_process(VICTIM);
        interrupted += r.interrupted;
        for (s, want) in servers.iter().zip(expected) {
            assert_eq!(
                (t.servers.inflight(*s), t.servers.pending(*s)),
                want,
                "server {} after kill {kills} ({} requests reclaimed, {} mid-update)",
                s.slot,
                r.requests,
                r.interrupted
            );
            assert_eq!(t.servers.inflight_of(VICTIM, *s), (0, 0));
        }
    }
    eprintln!("{kills} kills, {interrupted} inside an update of the in-flight counters; none lost a count");
    assert!(
        interrupted > 0,
        "none of {kills} kills landed inside an update: the window was not tested"
    );
}
