//! SIGKILL while processes charge one rate-limit bucket.
//!
//! Three real processes take units from one shared bucket in the segment's
//! rate-limit table ([`shm_layout::LimitTable`]) as fast as they can, each
//! writing one byte to its stdout per unit it was given, and are killed
//! with SIGKILL at random instants and started again, over and over, until
//! the bucket is empty. The bucket holds 1 000 000 units for a day (so it
//! barely refills while the test runs). What a client of the gateway
//! relies on:
//!
//! The test goes on until at least 30 kills landed while the bucket still
//! had units (processes charging it).
//!
//! * **never more than the limit**: the units given, counted from the
//!   bytes the processes wrote, are at most the limit (plus what the bucket
//!   refilled meanwhile);
//! * **no charge lost**: a kill loses at most the byte of the unit it was
//!   about to report, so the bytes are at least the limit less one per
//!   kill.
//!
//! Both are counted with what the bucket holds when the test ends: it
//! refills about one unit per 86 ms, so a slow final kill can leave a unit
//! or two in it, and those were not charged.
//!
//! A charge is one compare-and-swap, so a kill can only land before or
//! after it: there is nothing to reclaim. The children are this test binary
//! re-executed with `SEMLB_LIMITS_KILL_CHILD` naming the segment.

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use semlb_test_support as support;
use shm_layout::{Quota, Segment, Taken};

const CHILD_ENV: &str = "SEMLB_LIMITS_KILL_CHILD";
const KEY: u64 = 0x7e4a_a17e;
const QUOTA: Quota = Quota {
    limit: 1_000_000,
    period_ns: 86_400_000_000_000,
};

/// Child entry point: takes a unit at a time, reporting each, until killed.
#[test]
fn limits_kill_child() {
    let Ok(name) = std::env::var(CHILD_ENV) else {
        return;
    };
    let seg = Segment::open(&name).expect("open");
    let t = seg.tables();
    let clock = seg.clock();
    let mut out = std::io::stdout().lock();
    out.write_all(b"R").unwrap();
    out.flush().unwrap();
    loop {
        if let Taken::Allowed(_) = t.limits.take(KEY, QUOTA, 1, clock.now_ns()) {
            // Unbuffered: the byte is out before the next take.
            out.write_all(b"+").unwrap();
            out.flush().unwrap();
        }
    }
}

fn spawn(exe: &std::path::Path, name: &str) -> Child {
    let mut child = Command::new(exe)
        .args(["--exact", "limits_kill_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, name)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn a child");
    if !ready(&mut child) {
        let status = child.wait();
        panic!("the child ended before it was ready: {status:?}");
    }
    child
}

/// Reads `child`'s output up to its ready mark (the harness prints before
/// it); false if it ended first.
fn ready(child: &mut Child) -> bool {
    let out = child.stdout.as_mut().expect("piped");
    let mut byte = [0u8];
    while out.read(&mut byte).unwrap_or(0) == 1 {
        if byte[0] == b'R' {
            return true;
        }
    }
    false
}

/// Kills `child` and counts the units it reported.
fn kill_and_count(mut child: Child) -> u64 {
    kill(Pid::from_raw(child.id() as i32), Signal::SIGKILL).unwrap();
    let mut rest = Vec::new();
    child.stdout.take().unwrap().read_to_end(&mut rest).unwrap();
    assert!(!child.wait().unwrap().success());
    rest.iter().filter(|b| **b == b'+').count() as u64
}

#[test]
fn a_killed_charger_never_lets_more_than_the_limit_through() {
    let bench = support::segment::BenchSegment::create("limits-kill", 16 << 20);
    let name = bench.segment.name().expect("a named segment").to_owned();
    let t = bench.segment.tables();
    let clock = bench.segment.clock();
    let start_ns = clock.now_ns();
    let exe = std::env::current_exe().unwrap();
    let mut rng = support::Rng::from_seed(0x11a1_2026);
    let mut children: Vec<Child> = (0..3).map(|_| spawn(&exe, &name)).collect();
    let (mut given, mut kills, mut charging) = (0u64, 0u64, 0u64);
    loop {
        // A random instant of their loops (the choice of instant, not a
        // wait for anything).
        std::thread::sleep(Duration::from_micros(200 + rng.below(2000)));
        let i = rng.index(children.len());
        let victim = children.swap_remove(i);
        let empty_before =
            matches!(t.limits.take(KEY, QUOTA, 0, clock.now_ns()), Taken::Allowed(s) if s.remaining == 0);
        given += kill_and_count(victim);
        kills += 1;
        charging += u64::from(!empty_before);
        let empty = matches!(t.limits.take(KEY, QUOTA, 0, clock.now_ns()), Taken::Allowed(s) if s.remaining == 0);
        if empty && charging >= 30 {
            break;
        }
        assert!(kills < 20_000, "the bucket never emptied ({given} given)");
        children.push(spawn(&exe, &name));
    }
    for c in children.drain(..) {
        given += kill_and_count(c);
    }
    let now = clock.now_ns();
    // What the bucket refilled since before its first take (rounded up),
    // and what it holds now: the units charged are the limit plus the
    // refill less what is left.
    let refilled = (u128::from(now - start_ns) * u128::from(QUOTA.limit)).div_ceil(u128::from(QUOTA.period_ns)) as u64;
    let left = t.limits.peek(KEY, QUOTA, now).remaining;
    eprintln!(
        "{kills} kills ({charging} while the bucket had units), {given} units reported given of {} \
         (+{refilled} refilled, {left} left in the bucket)",
        QUOTA.limit
    );
    assert!(
        given + left <= QUOTA.limit + refilled,
        "{given} units given and {left} left, more than the limit {} (+{refilled} refilled)",
        QUOTA.limit
    );
    assert!(
        given + kills + left >= QUOTA.limit,
        "{given} reported + {kills} kills + {left} left < {}: charges were lost",
        QUOTA.limit
    );
}
