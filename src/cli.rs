//! The command line, as clap derive types. Parsing only: the commands run
//! in [`crate::shm_cmd`] and [`crate::demo`].

use clap::{Args, Parser, Subcommand};

use semlb::size::ByteSize;

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
