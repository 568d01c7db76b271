//! # semlb
//!
//! The `semlb` binary: the gateway (`semlb serve`: a supervisor and the
//! dispatcher and response processes it starts by re-running this binary),
//! and tools around the shared-memory segment. The gateway's parts live in
//! the `semlb` library (`src/lib.rs`); this binary holds the process edge.
//!
//! # Layout
//!
//! | module | concept |
//! | --- | --- |
//! | [`cli`] | the command line as clap derive types (parsing only: every command's arguments) |
//! | [`logging`] | the gateway processes' `tracing` subscriber: text or JSON lines on stderr |
//! | [`supervisor`] | `semlb serve`: segment, listener, signals; in it `children` (spawn, restart with backoff, watchdog), `backends` and `reload` (SIGHUP), `admin` (the admin API: HTTP side, commands, model pools), `systemd` and `sd_notify` (readiness, watchdog, status line), the metrics and side listeners, `upgrade`, `sims` (`--demo` engines) |
//! | [`child`] | the dispatcher and responder processes' edge (configuration, segment, signals; their loops are the library's), and `__sim` for `serve --demo` |
//! | [`commands`] | the other subcommands, one file each: `shm`, `report` (a segment's snapshot), `demo`, `status`, `keys`, `tokenize` |
//!
//! `semlb bench …` execs the `semlb-bench` binary next to this one
//! ([`run_bench`]): the benchmark reports are a crate of their own
//! (`benches/semlb-bench/`), so that this binary does not link their
//! plotting and progress-bar crates.
//!
//! # Flow
//!
//! `main` parses [`cli::Cli`] (clap prints usage errors and exits 2) and
//! hands the command to its module. Errors travel as `anyhow::Error` from
//! the commands to here, and only here are they printed: `error: <message>`
//! with its causes (an `error` event for the gateway's processes, which
//! log through [`logging`]), exit status 1. `anyhow` is used in this binary only;
//! the library's error types are typed.

/// mimalloc instead of glibc's malloc: the dispatch path (tokenizer, JSON)
/// makes many small allocations, which glibc's allocator spends about a
/// quarter of a dispatcher's CPU on (measured with perf; figures in the
/// issue notes).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod child;
mod cli;
mod commands;
mod logging;
mod supervisor;

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::Parser;

use crate::cli::{BenchArgs, ChildRole, Cli, Command};

/// `semlb bench ARGS…`: replaces this process with `semlb-bench ARGS…`
/// from this executable's own directory (where `cargo build --release -p
/// semlb -p semlb-bench` puts both); returns only if that fails.
fn run_bench(args: &BenchArgs) -> Result<()> {
    let here = std::env::current_exe().context("cannot find this executable")?;
    let bench = here.with_file_name("semlb-bench");
    if !bench.is_file() {
        bail!(
            "`semlb bench` runs {}, which is not there: build it with `cargo build --release -p semlb-bench` \
             (both binaries: `cargo build --release -p semlb -p semlb-bench`)",
            bench.display()
        );
    }
    // Its usage lines then read `semlb bench …`, as the user typed them.
    let err = std::process::Command::new(&bench)
        .arg0("semlb bench")
        .args(&args.args)
        .exec();
    Err(err).with_context(|| format!("cannot run {}", bench.display()))
}

fn run(cli: Cli) -> Result<()> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match cli.command {
        Command::Shm(command) => out.write_all(commands::shm::run(command)?.as_bytes())?,
        Command::Demo(args) => commands::demo::run(&args, &mut out)?,
        Command::Tokenize(args) => commands::tokenize::run(&args, &mut out)?,
        Command::Keys(args) => commands::keys::run(&args, &mut out)?,
        Command::Serve(args) => {
            logging::init(&args.log, "supervisor");
            supervisor::run(&args)?
        }
        Command::Child(args) => {
            let role = match args.role {
                ChildRole::Dispatcher => "dispatcher",
                ChildRole::Responder => "responder",
            };
            logging::init(&args.serve.log, &format!("{role} {}", args.index));
            child::run(&args)?
        }
        Command::Sim(args) => {
            logging::init(&args.log, "sim");
            child::run_sim(&args)?
        }
        Command::Bench(args) => run_bench(&args)?,
        Command::Status(args) => commands::status::run(&args, &mut out)?,
    }
    out.flush()?;
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The gateway's processes log through `tracing` (see [`logging`]), so
    // their last words are an event too (a JSON line with `--log-format json`).
    let logs = matches!(cli.command, Command::Serve(_) | Command::Child(_) | Command::Sim(_));
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // A closed stdout (`semlb shm inspect | head -1`) is not worth a message.
            let broken_pipe = e
                .downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe);
            if logs {
                tracing::error!("{e:#}");
            } else if !broken_pipe {
                let _ = writeln!(std::io::stderr(), "error: {e:#}");
            }
            ExitCode::FAILURE
        }
    }
}
