//! `semlb bench`, run as a user runs it: the `semlb` binary execs
//! `semlb-bench` from its own directory, which starts `semlb serve` and
//! `semlb __sim` from that directory too. `cargo test --workspace` builds
//! both binaries into the same `target/debug/` before any test runs; the
//! `semlb` these tests run is the one next to `semlb-bench`
//! (`semlb_test_support::process::semlb_exe`).

use std::process::Command;

use semlb_test_support::process::{assert_ok, run as semlb};

/// `semlb bench --help` is `semlb-bench`'s: it lists the reports.
#[test]
fn semlb_bench_runs_semlb_bench() {
    let text = assert_ok(&semlb(&["bench", "--help"]));
    for report in [
        "dispatch",
        "scaling",
        "e2e",
        "replay",
        "tokenizer",
        "proxy",
        "tenants",
        "all",
    ] {
        assert!(text.contains(report), "{report} missing:\n{text}");
    }
    assert!(text.contains("semlb bench"), "{text}");
}

/// `semlb bench proxy` runs end to end (engine, gateway, nginx when
/// installed, load) and writes its JSON; a smoke test, no figure is checked.
#[test]
fn bench_proxy_runs_and_writes_json() {
    let out = std::env::temp_dir().join(format!("semlb-test-cli-proxy-{}", std::process::id()));
    let out_arg = out.display().to_string();
    let nginx = Command::new("nginx").arg("-v").output().is_ok();
    let fronts = if nginx { "direct,semlb,nginx" } else { "direct,semlb" };
    let mut args = vec![
        "bench",
        "proxy",
        "--secs",
        "0.3",
        "--warmup",
        "0.1",
        "--connections",
        "2",
        "--prompt-tokens",
        "300",
        "--fronts",
        fronts,
        "--out",
        &out_arg,
    ];
    // On a one-CPU machine the front and the rest share it.
    let allowed = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .map(|v| v.trim().to_owned())
        })
        .unwrap_or_default();
    let first = allowed.split([',', '-']).next().unwrap_or("0").to_owned();
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        args.extend(["--front-cpu", &first, "--other-cpus", &first]);
    }
    let o = semlb(&args);
    let text = assert_ok(&o);
    assert!(
        text.contains("short chat requests") && text.contains("long chat prompts"),
        "{text}"
    );
    let json = std::fs::read_to_string(out.join("proxy.json")).expect("proxy.json written");
    let v: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
    assert_eq!(v["report"], "proxy");
    for workload in ["short", "long"] {
        let points = v["workloads"][workload]["points"].as_array().expect("points");
        assert_eq!(points.len(), if nginx { 3 } else { 2 }, "{workload}: {points:?}");
    }
    assert!(out.join("proxy.svg").is_file());
    if !nginx {
        eprintln!("nginx is not installed: its rows were not run");
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// `semlb bench tenants` runs its three modes end to end and writes both
/// tenants' figures; a smoke test, no figure is checked.
#[test]
fn bench_tenants_runs_and_writes_json() {
    let out = std::env::temp_dir().join(format!("semlb-test-cli-tenants-{}", std::process::id()));
    let out_arg = out.display().to_string();
    let text = assert_ok(&semlb(&[
        "bench",
        "tenants",
        "--noisy",
        "3",
        "--max-tokens",
        "4",
        "--warm-secs",
        "0",
        "--window-secs",
        "1",
        "--out",
        &out_arg,
    ]));
    assert!(text.contains("gateway queue, fair share"), "{text}");
    let json = std::fs::read_to_string(out.join("tenants.json")).expect("tenants.json written");
    let v: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
    for mode in [
        "engine_queues",
        "gateway_queue__oldest_first",
        "gateway_queue__fair_share",
    ] {
        for tenant in ["quiet", "noisy"] {
            assert!(
                v[mode][tenant]["requests"].as_u64().is_some_and(|n| n > 0),
                "{mode} {tenant}: {v}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// `semlb bench pd` runs both parts end to end (simulated engines in
/// every role, the gateway as a P/D router, streaming clients) on a tiny
/// workload and writes its JSON; a smoke test, no figure is checked.
#[test]
fn bench_pd_runs_and_writes_json() {
    let out = std::env::temp_dir().join(format!("semlb-test-cli-pd-{}", std::process::id()));
    let out_arg = out.display().to_string();
    let text = assert_ok(&semlb(&[
        "bench",
        "pd",
        "--engines",
        "2",
        "--topologies",
        "agg,1p1d",
        "--conv-topology",
        "1p1d",
        "--rates",
        "2",
        "--window-secs",
        "3",
        "--prompt-tokens",
        "400-600",
        "--output-tokens",
        "8-16",
        "--conv-rate",
        "2",
        "--conv-secs",
        "1",
        "--turns",
        "2",
        "--doc-tokens",
        "300-400",
        "--turn-output-tokens",
        "8",
        "--think-secs",
        "0.1",
        "--time-scale",
        "0.02",
        "--conv-time-scale",
        "0.02",
        "--out",
        &out_arg,
    ]));
    assert!(text.contains("1P+1D") && text.contains("random pairing"), "{text}");
    let json = std::fs::read_to_string(out.join("pd.json")).expect("pd.json written");
    let v: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
    for t in 0..2 {
        let point = &v["interference"]["topologies"][t]["points"][0]["figures"];
        assert!(point["answered"].as_u64().is_some_and(|n| n > 0), "{point}");
    }
    let split = &v["interference"]["topologies"][1]["points"][0]["figures"]["served"]["split"];
    assert!(split.as_u64().is_some_and(|n| n > 0), "{v}");
    let setups = v["conversations"]["setups"].as_object().expect("setups");
    assert_eq!(setups.len(), 3, "{v}");
    assert!(out.join("pd.svg").is_file());
    let _ = std::fs::remove_dir_all(&out);
}
