//! `semlb shm create | inspect | remove`: the operator's handle on the
//! shared-memory segment, a thin layer over [`shm_layout::Segment`].
//!
//! Each command returns the text to print, so `main` owns all output and
//! the commands stay testable.

use anyhow::{Context, Result};
use shm_layout::{LayoutPlan, PlanOptions, RegionKind, Segment};

use crate::cli::{CreateArgs, InspectArgs, NameArg, ShmCommand};
use crate::commands::report::Report;
use semlb::config::size::ByteSize;

/// Runs one `shm` subcommand and returns what to print.
pub fn run(command: ShmCommand) -> Result<String> {
    match command {
        ShmCommand::Create(args) => create(&args),
        ShmCommand::Inspect(args) => inspect(&args),
        ShmCommand::Remove(args) => remove(&args),
    }
}

/// Plans a segment of `size` bytes, with the error naming the size.
pub fn plan(size: ByteSize, max_response_fraction: f64) -> Result<LayoutPlan> {
    LayoutPlan::new(size.bytes(), PlanOptions { max_response_fraction })
        .with_context(|| format!("cannot lay out a segment of {size}"))
}

/// One line describing a freshly created segment.
pub fn summary(segment: &Segment) -> String {
    let h = segment.header();
    let log = h.region(RegionKind::ResponseLog);
    let rings = h.region(RegionKind::Rings);
    format!(
        "created shm segment {} ({}): {} prefix slots, {} response log (max value {}), {} completion rings of {}",
        segment.name().unwrap_or("(heap)"),
        ByteSize(h.segment_bytes),
        segment.tables().prefix.capacity(),
        ByteSize(log.count),
        ByteSize(log.param),
        rings.count,
        ByteSize(rings.param),
    )
}

fn create(args: &CreateArgs) -> Result<String> {
    let plan = plan(args.shm_size, args.max_response_fraction)?;
    let segment = Segment::create(&args.name.shm_name, &plan)?;
    Ok(format!("{}\n", summary(&segment)))
}

fn inspect(args: &InspectArgs) -> Result<String> {
    let segment = Segment::open(&args.name.shm_name)?;
    let report = Report::of(&segment);
    Ok(if args.json {
        format!("{:#}\n", report.json())
    } else {
        report.text()
    })
}

fn remove(args: &NameArg) -> Result<String> {
    // Refused while a supervisor owns it; held while removing, so that no
    // supervisor adopts it meanwhile.
    let _ownership = shm_layout::Ownership::take(&args.shm_name)?;
    Segment::remove(&args.shm_name)?;
    let path = shm_layout::shm_path(&args.shm_name)?;
    Ok(format!("removed shm segment {path}\n"))
}
