//! Throughput of the shm tables with 1, 2 and 4 processes on one segment.
//!
//! The parent creates a 256 MiB shm segment and populates the prefix table
//! (16 K conversations × 64 blocks = 1 M entries); then, for each workload
//! and process count, it re-executes this binary as N children that open the
//! same segment, signals them to start at the same moment (a byte on their
//! stdin), lets them run for a fixed time and sums the operations they
//! report. The scaling ratio is total ops/s with N processes over ops/s with
//! one. Workloads:
//!
//! * `lookup`: single-slot prefix lookups of random present keys;
//! * `lpm64`: longest-prefix match over a random 64-block chain;
//! * `dispatch`: what a dispatcher and responder do per request: a 16-block
//!   longest-prefix match, plus, for one request in ten, the write-back of
//!   the 16-block chain.
//!
//! `cargo bench --bench scaling` (`SEMLB_SCALING_SECS`, default 3, sets the
//! run time of each point). It prints figures; it asserts nothing.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use shm_layout::{Segment, Stamp};

use semlb_test_support::segment::{BenchSegment, chain, key, populate, servers};

const CHAINS: u64 = 16_384;
const CHILD_ENV: &str = "SEMLB_SCALING_CHILD";

fn main() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        child(&spec);
        return;
    }
    let secs: f64 = std::env::var("SEMLB_SCALING_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let bench = BenchSegment::create("scaling", 256 << 20);
    let srv = servers(&bench.segment, 8);
    populate(&bench.segment, &srv, CHAINS, 64);
    let name = bench.segment.name().expect("shm segment").to_owned();
    println!("shm scaling: {cores} cores, {secs} s per point, segment {name}");
    println!(
        "{:<10} {:>5} {:>14} {:>14} {:>8}",
        "workload", "procs", "ops/s total", "ops/s/proc", "scaling"
    );
    for workload in ["lookup", "lpm64", "dispatch"] {
        let mut base = 0.0;
        for procs in [1usize, 2, 4] {
            let total = run_point(&name, workload, procs, secs);
            if procs == 1 {
                base = total;
            }
            let note = if procs > cores {
                "  (more processes than cores)"
            } else {
                ""
            };
            println!(
                "{workload:<10} {procs:>5} {total:>14.0} {:>14.0} {:>7.2}x{note}",
                total / procs as f64,
                total / base
            );
        }
    }
}

fn run_point(name: &str, workload: &str, procs: usize, secs: f64) -> f64 {
    let exe = std::env::current_exe().expect("current exe");
    let mut children: Vec<_> = (0..procs)
        .map(|i| {
            Command::new(&exe)
                .env(CHILD_ENV, format!("{name},{workload},{secs},{i}"))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn child")
        })
        .collect();
    let mut outs: Vec<_> = children
        .iter_mut()
        .map(|c| BufReader::new(c.stdout.take().expect("stdout")))
        .collect();
    for out in &mut outs {
        let mut line = String::new();
        out.read_line(&mut line).expect("child ready");
        assert_eq!(line.trim(), "ready", "child failed to start");
    }
    for c in &mut children {
        c.stdin.as_mut().expect("stdin").write_all(b"g").expect("start child");
    }
    let mut total_ops = 0u64;
    let mut total_secs = 0.0f64;
    for (c, out) in children.iter_mut().zip(&mut outs) {
        let mut line = String::new();
        out.read_line(&mut line).expect("child result");
        let mut it = line.split_whitespace();
        total_ops += it.next().and_then(|s| s.parse::<u64>().ok()).expect("ops");
        total_secs += it.next().and_then(|s| s.parse::<f64>().ok()).expect("secs");
        assert!(c.wait().expect("wait child").success());
    }
    total_ops as f64 / (total_secs / procs as f64)
}

fn child(spec: &str) {
    let parts: Vec<&str> = spec.split(',').collect();
    let (name, workload, secs, id) = (
        parts[0],
        parts[1],
        parts[2].parse::<f64>().unwrap(),
        parts[3].parse::<u64>().unwrap(),
    );
    let seg = Segment::open(name).expect("open segment");
    let t = seg.tables();
    let srv: Vec<_> = (0..8u16).filter_map(|s| t.servers.current(s).map(|(r, _)| r)).collect();
    let hits: Vec<u64> = (0..1 << 16)
        .map(|i| chain(key(i ^ id << 32) % CHAINS, 64)[(i % 64) as usize])
        .collect();
    let chains: Vec<Vec<u64>> = (0..2048).map(|i| chain(key(i ^ id << 32) % CHAINS, 64)).collect();
    println!("ready");
    std::io::stdout().flush().unwrap();
    let mut go = [0u8; 1];
    std::io::stdin().read_exact(&mut go).expect("start signal");
    let deadline = Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut ops = 0u64;
    let mut sink = 0u64;
    'run: loop {
        for _ in 0..256 {
            let i = ops as usize;
            match workload {
                "lookup" => sink += t.prefix.lookup(hits[i & 0xffff]).is_some() as u64,
                "lpm64" => {
                    sink += u64::from(
                        t.prefix
                            .longest_prefix_match(&chains[i & 2047], |s| t.servers.is_live(s))
                            .best()
                            .map_or(0, |b| b.1),
                    )
                }
                _ => {
                    let c = &chains[i & 2047][..16];
                    sink += u64::from(
                        t.prefix
                            .longest_prefix_match(c, |s| t.servers.is_live(s))
                            .best()
                            .map_or(0, |b| b.1),
                    );
                    if i.is_multiple_of(10) {
                        t.prefix.insert_chain(c, srv[i % srv.len()], Stamp(2));
                    }
                }
            }
            ops += 1;
        }
        if start.elapsed() >= deadline {
            break 'run;
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    std::hint::black_box(sink);
    println!("{ops} {elapsed}");
}
