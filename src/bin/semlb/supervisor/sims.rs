//! The simulated engines of `semlb serve --demo N`: N `semlb __sim`
//! processes on loopback, started before the gateway and used as its
//! backends ([`start_sim`]).

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::cli::LogArgs;
use crate::supervisor::sd_notify;

/// Starts `semlb __sim` and returns it with its base URL.
pub(super) fn start_sim(time_scale: f64, log: &LogArgs) -> Result<(Child, String)> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args([
        "__sim",
        "--listen",
        "127.0.0.1:0",
        "--time-scale",
        &time_scale.to_string(),
    ])
    .args(log.to_args())
    .stdin(Stdio::null())
    .stdout(Stdio::piped());
    for var in sd_notify::ENV_VARS {
        cmd.env_remove(var);
    }
    // SAFETY: only prctl, an async-signal-safe call, runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0);
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting a demo engine")?;
    let mut line = String::new();
    let mut out = BufReader::new(child.stdout.take().expect("piped"));
    out.read_line(&mut line)?;
    // Keep draining its stdout so the engine never writes into a closed pipe.
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    let url = line
        .trim()
        .rsplit(' ')
        .next()
        .filter(|u| u.starts_with("http://"))
        .map(str::to_owned);
    match url {
        Some(url) => Ok((child, url)),
        None => {
            let _ = child.kill();
            bail!("the demo engine did not start (it printed {line:?})")
        }
    }
}
