//! The command line, as clap derive types: every command's arguments, and
//! parsing only. The commands run in [`crate::commands`],
//! [`crate::supervisor`] and [`crate::child`].

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use semlb::config::ServeOverrides;
use semlb::config::size::ByteSize;
use semlb::config::{DiscoveryKind, PdProtocol, RedisLookup, StoreKind};
use semlb::routing::PolicyKind;
use semlb::tenancy::fair_share::Priority;

/// semlb: a semantic, cache-aware load balancer for LLM inference servers.
#[derive(Debug, Parser)]
#[command(name = "semlb", version, about, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The top-level commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create, inspect or remove the shared-memory segment.
    #[command(subcommand)]
    Shm(ShmCommand),
    /// Replay synthetic conversations through a throw-away segment and show
    /// the routing decisions and the response cache.
    Demo(DemoArgs),
    /// Run the gateway: the supervisor creates the shm segment and keeps
    /// the dispatcher and response processes running.
    Serve(ServeArgs),
    /// A live view of a running gateway from its shm segment: servers,
    /// load, tables, processes (`--once` for one snapshot).
    Status(StatusArgs),
    /// What the gateway sees of a request body or a text: the prompt text,
    /// its segments, token ids and block hashes (and with --shm-name, which
    /// servers hold each block).
    Tokenize(TokenizeArgs),
    /// The clients' API keys file: add (prints the new key once), list,
    /// revoke; a reload applies it.
    Keys(KeysArgs),
    /// Measure: the dispatch path, scaling, end to end, trace replay; shm
    /// vs Redis. Prints tables, writes JSON and SVG plots. Runs the
    /// `semlb-bench` binary next to this one (`semlb bench --help` lists
    /// the reports).
    #[command(disable_help_flag = true)]
    Bench(BenchArgs),
    /// A process the supervisor starts (not for direct use).
    #[command(name = "__child", hide = true)]
    Child(ChildArgs),
    /// A simulated engine the supervisor starts for `serve --demo` (not
    /// for direct use; the full simulator is `semlb-sim`).
    #[command(name = "__sim", hide = true)]
    Sim(SimArgs),
}

/// `semlb bench ARGS…`: handed to `semlb-bench` as they are.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// The report and its flags (`semlb bench --help` lists the reports).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "ARGS")]
    pub args: Vec<OsString>,
}

/// `semlb serve`: every flag overrides the configuration file's key of the
/// same name (see `systemd/semlb.toml` for all keys and their defaults).
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// The TOML configuration file.
    #[arg(long, value_name = "FILE", env = "SEMLB_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to accept HTTP on (port 0 picks a free port).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Dispatcher processes [default: number of cores].
    #[arg(long, value_name = "N")]
    pub dispatchers: Option<usize>,
    /// Response processes [default: 1].
    #[arg(long, value_name = "N")]
    pub responders: Option<usize>,
    /// Shared-memory segment name [default: semlb].
    #[arg(long, value_name = "NAME")]
    pub shm_name: Option<String>,
    /// Shared-memory segment size [default: 256MiB].
    #[arg(long, value_name = "SIZE")]
    pub shm_size: Option<ByteSize>,
    /// An inference server, `http://host:port` (repeatable; replaces the
    /// file's `[[backend]]` list).
    #[arg(long = "backend", value_name = "URL")]
    pub backends: Vec<String>,
    /// A prefill engine of a disaggregated fleet, `http://host:port`
    /// (repeatable; with --backend and --decode, replaces the file's list).
    #[arg(long = "prefill", value_name = "URL")]
    pub prefill: Vec<String>,
    /// A decode engine of a disaggregated fleet, `http://host:port` (repeatable).
    #[arg(long = "decode", value_name = "URL")]
    pub decode: Vec<String>,
    /// How a disaggregated fleet's prefill and decode legs are driven:
    /// vllm-nixl (vLLM's NixlConnector) or sglang (bootstrap rendezvous)
    /// [default: vllm-nixl].
    #[arg(long, value_name = "PROTOCOL")]
    pub pd_protocol: Option<PdProtocol>,
    /// A tokenizer.json, or a GGUF model file (llama.cpp's: its tokenizer and chat template) [default: the bundled phi-2 tokenizer].
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    /// A HF tokenizer_config.json (or a GGUF model file) whose chat template
    /// renders chat prompts [default: a GGUF tokenizer's own, else the
    /// canonical rendering].
    #[arg(long, value_name = "PATH")]
    pub chat_template: Option<PathBuf>,
    /// Tokens per hashed block [default: 16].
    #[arg(long, value_name = "N")]
    pub block_size: Option<usize>,
    /// Routing policy [default: cache_aware].
    #[arg(long, value_name = "KIND", value_parser = policy_parser())]
    pub policy: Option<PolicyKind>,
    /// Where the routing state lives: shm (this host's segment) or redis.
    #[arg(long, value_name = "KIND")]
    pub store: Option<StoreKind>,
    /// The Redis of `--store redis` [default: redis://127.0.0.1:6379/].
    #[arg(long, value_name = "URL")]
    pub redis_url: Option<String>,
    /// Prefix of every Redis key [default: semlb].
    #[arg(long, value_name = "NS")]
    pub redis_namespace: Option<String>,
    /// Longest-prefix lookup on Redis: script (one round trip) or naive
    /// (one round trip per block, the sLLM paper's baseline).
    #[arg(long, value_name = "HOW")]
    pub redis_lookup: Option<RedisLookup>,
    /// Serve the admin API on this address (`[admin] listen`); it needs a
    /// bearer token (`--admin-token-file` or the file's `[admin]`).
    #[arg(long, value_name = "ADDR")]
    pub admin_listen: Option<SocketAddr>,
    /// A file holding the admin API's bearer token, not readable by others
    /// (replaces the file's `admin.token` and `admin.token_file`).
    #[arg(long, value_name = "PATH")]
    pub admin_token_file: Option<PathBuf>,
    /// Serve `GET /metrics` on this address, not on --listen
    /// (`[metrics] listen`).
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,
    /// Find backends at run time (`[discovery] kind`): file, kubernetes or
    /// inference-pool.
    #[arg(long, value_name = "KIND")]
    pub discovery: Option<DiscoveryKind>,
    /// The endpoints file of `--discovery file` (`discovery.path`).
    #[arg(long, value_name = "PATH")]
    pub discovery_file: Option<PathBuf>,
    /// The engine Pods' label selector of `--discovery kubernetes`
    /// (`discovery.selector`), e.g. `app=vllm`.
    #[arg(long, value_name = "SELECTOR")]
    pub discovery_selector: Option<String>,
    /// The Kubernetes namespace to discover in (`discovery.namespace`).
    #[arg(long, value_name = "NAMESPACE")]
    pub discovery_namespace: Option<String>,
    /// The discovered engines' port (`discovery.port`).
    #[arg(long, value_name = "PORT")]
    pub discovery_port: Option<u16>,
    /// The InferencePool of `--discovery inference-pool`
    /// (`discovery.inference_pool`).
    #[arg(long, value_name = "NAME")]
    pub inference_pool: Option<String>,
    /// Also serve the Gateway API Inference Extension's endpoint picker
    /// (Envoy's external processing, gRPC) on this address, from every
    /// dispatcher (`[epp] listen`).
    #[arg(long, value_name = "ADDR")]
    pub epp_listen: Option<SocketAddr>,
    /// Also start N simulated engines (default 3) on loopback and use them
    /// as the backends: the gateway runs on one machine with no GPU. Unless
    /// given, --listen is then 127.0.0.1:8080 and --shm-name semlb-demo.
    #[arg(long, value_name = "N", num_args = 0..=1, default_missing_value = "3")]
    pub demo: Option<usize>,
    /// `--time-scale` of the demo's simulated engines (0.05: 20x faster
    /// than an A100).
    #[arg(long, value_name = "F", default_value_t = 0.05)]
    pub demo_time_scale: f64,
    /// How the gateway's processes log to stderr.
    #[command(flatten)]
    pub log: LogArgs,
}

/// Logging flags of every process of a gateway (see [`crate::logging`]).
#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Log line format on stderr: text (for people) or json (one object
    /// per line).
    #[arg(long, value_name = "FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Least severe level logged: error, warn, info, debug (one line per
    /// request with its routing decision) or trace (other crates stay at
    /// info or less); or an EnvFilter directive such as
    /// `semlb::dispatcher=debug,info`. The environment variable SEMLB_LOG,
    /// if set, wins.
    #[arg(long, value_name = "LEVEL", default_value = "info", value_parser = parse_log_level)]
    pub log_level: String,
}

impl LogArgs {
    /// The flags again, for a child process.
    pub fn to_args(&self) -> Vec<OsString> {
        vec![
            "--log-format".into(),
            self.log_format.name().into(),
            "--log-level".into(),
            self.log_level.clone().into(),
        ]
    }
}

/// `--policy`: every policy by name, each with its one line in `--help`.
fn policy_parser() -> impl clap::builder::TypedValueParser<Value = PolicyKind> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new(PolicyKind::ALL.map(|kind| PossibleValue::new(kind.name()).help(kind.summary()))).map(
        |name| {
            PolicyKind::ALL
                .into_iter()
                .find(|kind| kind.name() == name)
                .expect("a possible value is a policy's name")
        },
    )
}

/// Checks a `--log-level` as an EnvFilter directive.
fn parse_log_level(s: &str) -> Result<String, String> {
    tracing_subscriber::EnvFilter::builder()
        .parse(s)
        .map(|_| s.to_owned())
        .map_err(|e| format!("not a log level or filter directive: {e}"))
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// `TIMESTAMP LEVEL ROLE: message key=value ...`.
    Text,
    /// One JSON object per line.
    Json,
}

impl LogFormat {
    /// The flag's value.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Text => "text",
            Self::Json => "json",
        }
    }
}

impl ServeArgs {
    /// The flags as configuration overrides.
    pub fn overrides(&self) -> ServeOverrides {
        ServeOverrides {
            listen: self.listen,
            dispatchers: self.dispatchers,
            responders: self.responders,
            shm_name: self.shm_name.clone(),
            shm_size: self.shm_size,
            backends: (!self.backends.is_empty()).then(|| self.backends.clone()),
            prefill: self.prefill.clone(),
            decode: self.decode.clone(),
            pd_protocol: self.pd_protocol,
            tokenizer: self.tokenizer.clone(),
            chat_template: self.chat_template.clone(),
            block_size: self.block_size,
            policy: self.policy,
            store: self.store,
            redis_url: self.redis_url.clone(),
            redis_namespace: self.redis_namespace.clone(),
            redis_lookup: self.redis_lookup,
            admin_listen: self.admin_listen,
            admin_token_file: self.admin_token_file.clone(),
            metrics_listen: self.metrics_listen,
            discovery: self.discovery,
            discovery_file: self.discovery_file.clone(),
            discovery_selector: self.discovery_selector.clone(),
            discovery_namespace: self.discovery_namespace.clone(),
            discovery_port: self.discovery_port,
            inference_pool: self.inference_pool.clone(),
            epp_listen: self.epp_listen,
        }
    }

    /// The flags again, for a child process (never `--demo`: children use
    /// the backends the supervisor hands them).
    pub fn to_args(&self) -> Vec<OsString> {
        let mut out: Vec<OsString> = Vec::new();
        // Each flag given, with its value as the command line spells it.
        let mut flag = |name: &str, value: Option<String>| {
            if let Some(value) = value {
                out.push(name.into());
                out.push(value.into());
            }
        };
        flag("--config", self.config.as_ref().map(|v| v.display().to_string()));
        flag("--listen", self.listen.map(|v| v.to_string()));
        flag("--dispatchers", self.dispatchers.map(|v| v.to_string()));
        flag("--responders", self.responders.map(|v| v.to_string()));
        flag("--shm-name", self.shm_name.clone());
        flag("--shm-size", self.shm_size.map(|v| v.0.to_string()));
        for b in &self.backends {
            flag("--backend", Some(b.clone()));
        }
        for b in &self.prefill {
            flag("--prefill", Some(b.clone()));
        }
        for b in &self.decode {
            flag("--decode", Some(b.clone()));
        }
        flag("--pd-protocol", self.pd_protocol.map(|p| p.name().to_owned()));
        flag("--tokenizer", self.tokenizer.as_ref().map(|v| v.display().to_string()));
        flag(
            "--chat-template",
            self.chat_template.as_ref().map(|v| v.display().to_string()),
        );
        flag("--block-size", self.block_size.map(|v| v.to_string()));
        flag("--policy", self.policy.map(|v| v.to_string()));
        flag("--store", self.store.map(|v| v.to_string()));
        flag("--redis-url", self.redis_url.clone());
        flag("--redis-namespace", self.redis_namespace.clone());
        flag(
            "--redis-lookup",
            self.redis_lookup.map(|v| match v {
                RedisLookup::Script => "script".to_owned(),
                RedisLookup::Naive => "naive".to_owned(),
            }),
        );
        flag("--admin-listen", self.admin_listen.map(|v| v.to_string()));
        flag(
            "--admin-token-file",
            self.admin_token_file.as_ref().map(|v| v.display().to_string()),
        );
        flag("--metrics-listen", self.metrics_listen.map(|v| v.to_string()));
        flag("--discovery", self.discovery.map(|v| v.to_string()));
        flag(
            "--discovery-file",
            self.discovery_file.as_ref().map(|v| v.display().to_string()),
        );
        flag("--discovery-selector", self.discovery_selector.clone());
        flag("--discovery-namespace", self.discovery_namespace.clone());
        flag("--discovery-port", self.discovery_port.map(|v| v.to_string()));
        flag("--inference-pool", self.inference_pool.clone());
        flag("--epp-listen", self.epp_listen.map(|v| v.to_string()));
        out.extend(self.log.to_args());
        out
    }
}

/// The roles of child processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ChildRole {
    /// HTTP front and routing.
    Dispatcher,
    /// Write-back of completion records.
    Responder,
}

/// `semlb __child`: how the supervisor starts a child.
#[derive(Debug, Args)]
pub struct ChildArgs {
    /// What the child does.
    #[arg(long)]
    pub role: ChildRole,
    /// Its registry slot.
    #[arg(long)]
    pub slot: u16,
    /// Its registry incarnation.
    #[arg(long)]
    pub incarnation: u32,
    /// Dispatcher: its completion ring. Responder: its index among the responders.
    #[arg(long)]
    pub index: usize,
    /// The supervisor's configuration flags.
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// `semlb __sim`: a simulated engine with default parameters.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Real duration of one simulated second.
    #[arg(long, default_value_t = 0.05)]
    pub time_scale: f64,
    /// The served model name.
    #[arg(long, default_value = "semlb-sim")]
    pub model: String,
    /// Streamed answers broken mid-way (`semlb-sim --stream-fault`).
    #[command(flatten)]
    pub stream_faults: semlb_workers::faults::StreamFaultArgs,
    /// A LoRA adapter it also serves (repeatable; see `semlb-sim --lora`).
    #[arg(long = "lora", value_name = "NAME")]
    pub lora_adapters: Vec<String>,
    /// Tokens per KV block [default: the simulator's, 16, vLLM's].
    #[arg(long, value_name = "TOKENS")]
    pub block_size: Option<u32>,
    /// KV-cache capacity in tokens [default: the simulator's, 400 000];
    /// a small one makes the engine evict often.
    #[arg(long, value_name = "TOKENS")]
    pub kv_capacity_tokens: Option<u64>,
    /// Most requests in its running batch [default: the simulator's, 256];
    /// the rest wait in its queue.
    #[arg(long, value_name = "N")]
    pub max_num_seqs: Option<u32>,
    /// Longest prompt + output it takes, in tokens [default: the
    /// simulator's, 32 768]; `/v1/models` says it (`max_model_len`).
    #[arg(long, value_name = "TOKENS")]
    pub max_model_len: Option<u32>,
    /// Serve no `/metrics` (404), as an engine started without metrics.
    #[arg(long)]
    pub no_metrics: bool,
    /// Answer llama.cpp's `GET /props` (`total_slots` = the batch size),
    /// as `llama-server` does.
    #[arg(long)]
    pub props: bool,
    /// Publish KV cache events as vLLM does (vLLM's `--kv-events-config`
    /// JSON; see `semlb-sim --kv-events-config`).
    #[arg(long, value_name = "JSON")]
    pub kv_events_config: Option<String>,
    /// Disaggregated prefill/decode (the same flags as `semlb-sim`'s).
    #[command(flatten)]
    pub pd: semlb_workers::pd::PdConfig,
    /// How it logs to stderr.
    #[command(flatten)]
    pub log: LogArgs,
}

/// `semlb status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The gateway's segment name (its `shm_name`).
    #[arg(long, value_name = "NAME", env = "SEMLB_SHM_NAME", default_value = semlb::config::DEFAULT_SHM_NAME)]
    pub shm_name: String,
    /// Print one snapshot and exit.
    #[arg(long)]
    pub once: bool,
    /// Seconds between frames.
    #[arg(long, value_name = "SECS", default_value_t = 1.0)]
    pub interval: f64,
    /// Stop after this many frames [default: never, or 1 with --once].
    #[arg(long, value_name = "N")]
    pub iterations: Option<u64>,
}

/// `semlb shm …`.
#[derive(Debug, Subcommand)]
pub enum ShmCommand {
    /// Create a segment and leave it in place (prints a one-line summary).
    Create(CreateArgs),
    /// Print a segment's header, regions and table statistics.
    Inspect(InspectArgs),
    /// Remove a segment (processes that have it mapped keep their mapping).
    Remove(NameArg),
}

/// The segment name every `shm` command takes.
#[derive(Debug, Args)]
pub struct NameArg {
    /// Segment name, as for shm_open(3); it appears as /dev/shm/NAME.
    #[arg(long, value_name = "NAME", env = "SEMLB_SHM_NAME")]
    pub shm_name: String,
}

/// `semlb shm create`.
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// The segment to create.
    #[command(flatten)]
    pub name: NameArg,
    /// Segment size: 256MiB, 1GiB, 64M, 100MB (K/M/G/T and KiB… are
    /// binary, KB/MB/GB/TB decimal).
    #[arg(long, value_name = "SIZE", default_value = "256MiB", env = "SEMLB_SHM_SIZE")]
    pub shm_size: ByteSize,
    /// Largest share of the response log one cached response may take,
    /// in (0, 0.5].
    #[arg(long, value_name = "FRACTION", default_value_t = shm_layout::plan::DEFAULT_MAX_RESPONSE_FRACTION)]
    pub max_response_fraction: f64,
}

/// `semlb shm inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The segment to inspect.
    #[command(flatten)]
    pub name: NameArg,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `semlb demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Size of the throw-away segment.
    #[arg(long, value_name = "SIZE", default_value = "64MiB")]
    pub shm_size: ByteSize,
    /// Name of the throw-away segment [default: semlb-demo-PID]. It must
    /// not exist; it is removed when the demo ends, also on error.
    #[arg(long, value_name = "NAME")]
    pub shm_name: Option<String>,
}

/// `semlb tokenize`.
#[derive(Debug, Clone, Args)]
pub struct TokenizeArgs {
    /// The text to tokenize (as a completions prompt). Or use --file,
    /// --body, --body-file or --jsonl.
    pub text: Option<String>,
    /// Read the text from a file (`-`: stdin).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["text", "body", "body_file", "jsonl"])]
    pub file: Option<PathBuf>,
    /// An OpenAI request body (JSON): chat messages are rendered with the
    /// chat template, as the gateway renders them.
    #[arg(long, value_name = "JSON", conflicts_with_all = ["text", "body_file", "jsonl"])]
    pub body: Option<String>,
    /// Read the request body from a file (`-`: stdin).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["text", "jsonl"])]
    pub body_file: Option<PathBuf>,
    /// The endpoint a body is for [default: Responses if it has `input`,
    /// chat if it has `messages`, else completions].
    #[arg(long, value_name = "ENDPOINT")]
    pub endpoint: Option<EndpointArg>,
    /// Read one JSON string (a text) or object (a body) per line on stdin;
    /// write one JSON object per line.
    #[arg(long)]
    pub jsonl: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Take `tokenizer`, `chat_template` and `block_size` from this
    /// `semlb serve` configuration file.
    #[arg(long, value_name = "FILE", env = "SEMLB_CONFIG")]
    pub config: Option<PathBuf>,
    /// A tokenizer.json or GGUF model file [default: the configuration's, else the bundled one].
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    /// A tokenizer_config.json or GGUF model file whose chat template renders chat bodies
    /// [default: the configuration's, else a GGUF tokenizer's own, else the canonical rendering].
    #[arg(long, value_name = "PATH")]
    pub chat_template: Option<PathBuf>,
    /// Tokens per block [default: the configuration's, else 16].
    #[arg(long, value_name = "N")]
    pub block_size: Option<usize>,
    /// The model a text's chain is rooted at (a body names its own).
    #[arg(long, value_name = "NAME", default_value = "semlb-sim")]
    pub model: String,
    /// A running gateway's segment: use its seed, and show which servers
    /// hold each block.
    #[arg(long, value_name = "NAME")]
    pub shm_name: Option<String>,
    /// The hash seed without --shm-name.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,
}

/// `--endpoint`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EndpointArg {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// `/v1/responses` (OpenAI's Responses API).
    Responses,
    /// `/v1/messages` (Anthropic's Messages API).
    Messages,
}

/// `semlb keys`.
#[derive(Debug, Args)]
pub struct KeysArgs {
    /// The keys file [default: the configuration's `auth.keys_file`].
    #[arg(long, value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// The configuration whose `auth.keys_file` to use.
    #[arg(long, value_name = "FILE", env = "SEMLB_CONFIG")]
    pub config: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub action: KeysAction,
}

/// What `semlb keys` does.
#[derive(Debug, Subcommand)]
pub enum KeysAction {
    /// Make a key for a tenant and print it (once).
    Add {
        /// The tenant the key names (its callers share a response cache).
        #[arg(long)]
        tenant: String,
        /// A model name or alias the key may use (repeatable) [default: every model].
        #[arg(long = "model", value_name = "NAME")]
        models: Vec<String>,
    },
    /// List the keys (ids, tenants, models; never the keys).
    List,
    /// Remove a key.
    Revoke {
        /// Its id (`semlb keys list`).
        id: String,
    },
    /// Set a tenant's rate limits, class and weight (none given: remove
    /// its settings).
    #[command(alias = "tenant")]
    Limit {
        /// The tenant (`*`: every tenant without settings of its own).
        #[arg(long)]
        tenant: String,
        /// Requests per minute.
        #[arg(long, value_name = "N")]
        requests_per_minute: Option<u64>,
        /// Prompt and output tokens per minute.
        #[arg(long, value_name = "N")]
        tokens_per_minute: Option<u64>,
        /// Its class in the gateway queue: interactive or batch.
        #[arg(long, value_name = "CLASS", value_parser = parse_priority)]
        priority: Option<Priority>,
        /// Its weight in the gateway queue's fair share (1 to 1000).
        #[arg(long, value_name = "N")]
        weight: Option<u32>,
        /// Keep its prompts' prefixes apart from other tenants'.
        #[arg(long)]
        isolate_prefixes: bool,
        /// Its requests in flight at once on a gateway host (streams
        /// included); one more gets 429.
        #[arg(long, value_name = "N")]
        max_concurrent_requests: Option<u64>,
    },
}

/// A class named on the command line.
fn parse_priority(text: &str) -> Result<Priority, String> {
    match text {
        "interactive" => Ok(Priority::Interactive),
        "batch" => Ok(Priority::Batch),
        other => Err(format!("{other:?} is not a class: interactive or batch")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_sizes_and_defaults() {
        let cli = Cli::try_parse_from(["semlb", "shm", "create", "--shm-name", "x", "--shm-size", "1.5GiB"]).unwrap();
        let Command::Shm(ShmCommand::Create(args)) = cli.command else {
            panic!("not create: {cli:?}");
        };
        assert_eq!(args.shm_size, ByteSize(3 << 29));
        assert_eq!(args.max_response_fraction, 0.125);
        let cli = Cli::try_parse_from(["semlb", "demo"]).unwrap();
        let Command::Demo(args) = cli.command else {
            panic!("not demo: {cli:?}");
        };
        assert_eq!((args.shm_size, args.shm_name), (ByteSize(64 << 20), None));
    }

    #[test]
    fn a_bad_size_is_a_usage_error_naming_the_input() {
        let err = Cli::try_parse_from(["semlb", "demo", "--shm-size", "12XB"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
        assert!(err.to_string().contains("12XB"), "{err}");
    }
}
