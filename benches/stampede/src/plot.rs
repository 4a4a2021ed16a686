//! `--plot`: a PNG with one panel per mode: every read's latency over time (grey dots, log scale)
//! and the moments loads started (red lines).

use std::error::Error;
use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::register_font;

use crate::ModeRun;
use crate::args::Args;

const WIDTH: u32 = 1000;
const TITLE_HEIGHT: u32 = 40;
const PANEL_HEIGHT: u32 = 200;
/// The latency axis, in ms.
const LATENCY_MS: std::ops::Range<f64> = 0.01..1000.0;
const FONT: &str = "sans-serif";
const READ: RGBColor = RGBColor(110, 110, 110);
const LOAD: RGBColor = RGBColor(220, 30, 30);

/// Draws the runs' panels into a PNG at `path`.
pub fn write(path: &Path, args: &Args, runs: &[ModeRun]) -> Result<(), Box<dyn Error>> {
    // plotters' ab_glyph text has no system fonts: give it the bundled Noto Sans.
    register_font(FONT, FontStyle::Normal, ttf_noto_sans::REGULAR)
        .map_err(|_| "the bundled font could not be read")?;
    let height = TITLE_HEIGHT + PANEL_HEIGHT * runs.len() as u32;
    let root = BitMapBackend::new(path, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let title = format!(
        "newcache stampede: {}x{} workers, loader {} ms, ttl {} s{}  (grey: read latency, red: a load started)",
        args.procs,
        args.threads,
        args.loader_ms,
        args.ttl,
        if args.cold { ", cold" } else { "" },
    );
    let panels = root.titled(&title, (FONT, 18))?;
    for (area, run) in panels.split_evenly((runs.len(), 1)).iter().zip(runs) {
        panel(area, args, run)?;
    }
    root.present()?;
    Ok(())
}

fn panel(
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    args: &Args,
    run: &ModeRun,
) -> Result<(), Box<dyn Error>> {
    let caption = format!("{}: {} loads", run.mode, run.starts.len());
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 16))
        .margin_right(20)
        .x_label_area_size(35)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..args.duration, LATENCY_MS.log_scale())?;
    chart
        .configure_mesh()
        .light_line_style(TRANSPARENT)
        .x_desc("time (s)")
        .y_desc("read latency (ms)")
        .y_label_formatter(&|ms| format!("{ms}"))
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 14))
        .draw()?;
    // Reads and loads off the axes are drawn at their edges.
    let time = |t: f64| t.clamp(0.0, args.duration);
    let latency_ms = |seconds: f64| (seconds * 1000.0).clamp(LATENCY_MS.start, LATENCY_MS.end);
    chart.draw_series(
        run.lat
            .iter()
            .map(|&(t, d)| Pixel::new((time(t.into()), latency_ms(d.into())), READ)),
    )?;
    chart.draw_series(run.starts.iter().map(|&start| {
        let t = time(start - run.t0);
        PathElement::new([(t, LATENCY_MS.start), (t, LATENCY_MS.end)], LOAD)
    }))?;
    Ok(())
}
