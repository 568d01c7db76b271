//! (placeholder, being written)

use anyhow::Result;
use clap::Args;

use super::Common;

/// Flags.
#[derive(Debug, Clone, Args)]
pub struct EndToEndArgs {
    /// Common flags.
    #[command(flatten)]
    pub common: Common,
}

impl EndToEndArgs {
    /// Defaults with `common`.
    pub fn with(common: Common) -> Self {
        Self { common }
    }
}

/// Runs the report.
pub fn run(_args: &EndToEndArgs) -> Result<()> {
    anyhow::bail!("not written yet")
}
