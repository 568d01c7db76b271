//! (placeholder, being written)

use anyhow::Result;
use clap::Args;

use super::Common;

/// Flags.
#[derive(Debug, Clone, Args)]
pub struct ScalingArgs {
    /// Common flags.
    #[command(flatten)]
    pub common: Common,
}

impl ScalingArgs {
    /// Defaults with `common`.
    pub fn with(common: Common) -> Self {
        Self { common }
    }
}

/// Runs the report.
pub fn run(_args: &ScalingArgs) -> Result<()> {
    anyhow::bail!("not written yet")
}

/// `semlb __bench-worker` flags.
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {}

/// Runs one load process.
pub fn run_worker(_args: &WorkerArgs) -> Result<()> {
    anyhow::bail!("not written yet")
}
