//! The servers of `semlb bench proxy`: the simulated engine and the fronts
//! in front of it (`semlb serve`, nginx), started on their CPUs, and one
//! check request of each workload through each front before measuring.

use std::time::Duration;

use anyhow::{Context, Result, bail};

use super::procs::{Address, CpuList, EngineSpec, Gateway, Interrupt, Nginx, NginxError, Server};
use super::workloads::{TextSource, Workload};
use super::{Front, ProxyArgs};

/// The servers of the run.
pub(super) struct Servers {
    pub(super) engine: Server,
    pub(super) gateway: Option<Gateway>,
    pub(super) nginx: Option<Nginx>,
    pub(super) nginx_skipped: Option<String>,
}

impl Servers {
    pub(super) fn addr(&self, front: Front) -> Option<&str> {
        match front {
            Front::Direct => Some(&self.engine.addr),
            Front::Semlb => self.gateway.as_ref().map(|g| g.server.addr.as_str()),
            Front::Nginx => self.nginx.as_ref().map(|n| n.server.addr.as_str()),
        }
    }

    pub(super) fn front_pid(&self, front: Front) -> Option<i32> {
        match front {
            Front::Direct => None,
            Front::Semlb => self.gateway.as_ref().map(|g| g.server.pid()),
            Front::Nginx => self.nginx.as_ref().map(|n| n.server.pid()),
        }
    }
}

/// The engine to run: `--sim`, `semlb-sim` next to this executable, or
/// `semlb __sim`.
pub(super) fn engine_spec(args: &ProxyArgs, text: &TextSource) -> Result<EngineSpec> {
    let here = std::env::current_exe().context("cannot find the current executable")?;
    let sibling = here.with_file_name("semlb-sim");
    let exe = crate::semlb_exe()?;
    let sim = args.sim.clone().or_else(|| sibling.is_file().then_some(sibling));
    let scale = args.time_scale.to_string();
    Ok(match sim {
        Some(program) => {
            let mut a: Vec<String> = ["--listen", "127.0.0.1:0", "--time-scale", &scale]
                .map(str::to_owned)
                .into();
            let tokenizer = match &text.files {
                Some((tok, template)) => {
                    a.extend([
                        "--tokenizer".into(),
                        tok.display().to_string(),
                        "--chat-template".into(),
                        template.display().to_string(),
                    ]);
                    "the gateway's tokenizer and chat template"
                }
                None => "the bundled phi-2 tokenizer and the canonical template",
            };
            EngineSpec {
                description: format!("{} (time scale {scale}; {tokenizer})", program.display()),
                program,
                args: a,
            }
        }
        None => EngineSpec {
            description: format!(
                "semlb __sim (time scale {scale}; bundled phi-2 tokenizer, canonical template: no semlb-sim next to \
                 {}; `cargo build --release -p semlb-workers` or --sim PATH gives the engine the gateway's tokenizer)",
                here.display()
            ),
            args: ["__sim", "--listen", "127.0.0.1:0", "--time-scale", &scale]
                .map(str::to_owned)
                .into(),
            program: exe,
        },
    })
}

pub(super) fn start_servers(
    args: &ProxyArgs,
    text: &TextSource,
    engine: &EngineSpec,
    front: &CpuList,
    other: &CpuList,
    interrupt: &Interrupt,
) -> Result<Servers> {
    let engine = Server::start(
        "the simulated engine",
        &engine.program,
        &engine.args,
        other,
        Address::Printed,
        Duration::from_secs(60),
        interrupt,
    )?;
    let gateway = if args.fronts.contains(&Front::Semlb) {
        let extra: Vec<String> = match &text.files {
            Some((tok, template)) => vec![
                "--tokenizer".into(),
                tok.display().to_string(),
                "--chat-template".into(),
                template.display().to_string(),
            ],
            None => Vec::new(),
        };
        Some(Gateway::start(&engine.addr, &extra, front, interrupt)?)
    } else {
        None
    };
    let (nginx, nginx_skipped) = if args.fronts.contains(&Front::Nginx) {
        match Nginx::start(&args.nginx, &engine.addr, front, interrupt) {
            Ok(n) => (Some(n), None),
            Err(NginxError::NotInstalled(why)) => (None, Some(why)),
            Err(NginxError::Other(e)) => return Err(e.context("starting nginx")),
        }
    } else {
        (None, None)
    };
    Ok(Servers {
        engine,
        gateway,
        nginx,
        nginx_skipped,
    })
}

/// One request of `workload` through `addr` on a fresh connection: the
/// engine's prompt token count, or an error with the answer.
pub(super) fn check(addr: &str, workload: &Workload, front: Front) -> Result<Option<u64>> {
    use std::io::{Read, Write};
    // A connection number no load connection has.
    let body = workload.requests.body(1_000_000, 0);
    let mut s = std::net::TcpStream::connect(addr).with_context(|| format!("{}: cannot connect", front.name()))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        s,
        "POST {} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        workload.path,
        body.len()
    )?;
    s.write_all(&body)?;
    let mut answer = Vec::new();
    s.read_to_end(&mut answer)
        .with_context(|| format!("{}: reading the answer", front.name()))?;
    let text = String::from_utf8_lossy(&answer);
    if !text.starts_with("HTTP/1.1 200") && !text.starts_with("HTTP/1.0 200") {
        bail!(
            "{} answered a {} request with {}",
            front.name(),
            workload.kind.name(),
            text.chars().take(600).collect::<String>()
        );
    }
    // `"prompt_tokens":N` in the JSON body, or in the stream's last events
    // (Responses: `"input_tokens":N`; Messages: `"input_tokens":N` uncached
    // plus `"cache_read_input_tokens":M`).
    let number = |key: &str| -> Option<u64> {
        text.rsplit_once(key)
            .and_then(|(_, rest)| rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
    };
    Ok(number("\"prompt_tokens\":")
        .or_else(|| number("\"input_tokens\":").map(|n| n + number("\"cache_read_input_tokens\":").unwrap_or(0))))
}
