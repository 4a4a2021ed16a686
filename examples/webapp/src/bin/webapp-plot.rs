//! Draws the webapp's per-second series (`GET /series` JSON, one file per process) into an SVG:
//! requests/s on top, database queries/s below, the processes summed second by second.
//!
//! ```sh
//! cargo run --release -p newcache-webapp --bin webapp-plot -- --out plot.svg a.json b.json
//! ```

use std::collections::BTreeMap;
use std::error::Error;
use std::path::PathBuf;

use clap::Parser;
use newcache_webapp::Series;
use plotters::prelude::*;

/// Plot requests/s and database queries/s from one or more `/series` files.
#[derive(Parser)]
struct Args {
    /// The SVG to write.
    #[arg(long)]
    out: PathBuf,
    /// A title for the plot.
    #[arg(
        long,
        default_value = "newcache webapp: requests and database queries per second"
    )]
    title: String,
    /// `/series` JSON files (one per process); summed per second.
    #[arg(required = true)]
    series: Vec<PathBuf>,
}

fn main() -> Result<(), Box<dyn Error>> {
    let args = Args::parse();

    // Sum the processes' samples per whole second since the Unix epoch.
    let mut per_second: BTreeMap<i64, (u64, u64)> = BTreeMap::new();
    let mut ttl = None;
    for path in &args.series {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        let series: Series = serde_json::from_str(&text)
            .map_err(|e| format!("{} is not a /series body: {e}", path.display()))?;
        ttl = ttl.or(Some(series.ttl_secs));
        for s in series.samples {
            let entry = per_second.entry(s.unix_secs.floor() as i64).or_default();
            entry.0 += s.requests;
            entry.1 += s.db_queries;
        }
    }
    let (Some(&first), Some(&last)) = (per_second.keys().next(), per_second.keys().last()) else {
        return Err("the series have no samples (did the service run for a second?)".into());
    };
    let points: Vec<(i64, u64, u64)> = (first..=last)
        .map(|t| {
            let (r, q) = per_second.get(&t).copied().unwrap_or_default();
            (t - first, r, q)
        })
        .collect();
    let span = (last - first).max(1);
    let max_requests = points.iter().map(|p| p.1).max().unwrap_or(0).max(1);
    let max_queries = points.iter().map(|p| p.2).max().unwrap_or(0).max(1);

    let root = SVGBackend::new(&args.out, (1000, 640)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(&args.title, ("sans-serif", 20))?;
    let (top, bottom) = root.split_vertically(320);

    let mut chart = ChartBuilder::on(&top)
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(70)
        .build_cartesian_2d(0..span, 0..max_requests + max_requests / 10)?;
    chart
        .configure_mesh()
        .y_desc("requests/s")
        .x_desc("seconds")
        .draw()?;
    chart.draw_series(LineSeries::new(
        points.iter().map(|&(t, r, _)| (t, r)),
        &BLUE,
    ))?;

    let mut chart = ChartBuilder::on(&bottom)
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(70)
        .build_cartesian_2d(0..span, 0..max_queries + 1)?;
    let ttl_note = ttl.map(|t| format!(" (ttl {t} s)")).unwrap_or_default();
    chart
        .configure_mesh()
        .y_desc(format!("db queries/s{ttl_note}"))
        .x_desc("seconds")
        .draw()?;
    chart.draw_series(
        points
            .iter()
            .map(|&(t, _, q)| Circle::new((t, q), 3, RED.filled())),
    )?;
    chart.draw_series(LineSeries::new(
        points.iter().map(|&(t, _, q)| (t, q)),
        &RED,
    ))?;

    root.present()?;
    println!(
        "{}: {} s, peak {} requests/s, {} db queries in all",
        args.out.display(),
        span + 1,
        max_requests,
        points.iter().map(|p| p.2).sum::<u64>()
    );
    Ok(())
}
