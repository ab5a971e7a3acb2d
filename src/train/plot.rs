//! The loss and accuracy curves of a run, drawn from its `metrics.jsonl` into an SVG: loss on
//! the left, accuracy on the right, against the optimiser step: one line per split (train,
//! val, test: the epochs' evaluations) and one for the step records (single batches).

use std::path::Path;

use anyhow::Result;
use plotters::prelude::*;

use super::checkpoint::read_metrics;

/// One split's (step, value) points.
type Series = Vec<(f64, f64)>;

/// Reads `metrics` (a run's `metrics.jsonl`, see [`super::checkpoint::MetricRecord`]) and writes the curves to
/// `svg`.
pub fn curves(metrics: &Path, svg: &Path) -> Result<()> {
    let splits = ["step", "train", "val", "test"];
    let mut loss: Vec<Series> = vec![Vec::new(); splits.len()];
    let mut acc: Vec<Series> = vec![Vec::new(); splits.len()];
    for r in read_metrics(metrics)? {
        if let Some(s) = splits.iter().position(|&n| n == r.split) {
            loss[s].push((r.step as f64, r.loss));
            if let Some(a) = r.accuracy {
                acc[s].push((r.step as f64, a));
            }
        }
    }
    let last_step = loss.iter().flatten().map(|p| p.0).fold(1.0f64, f64::max);
    let max_loss = loss
        .iter()
        .flatten()
        .map(|p| p.1)
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let root = SVGBackend::new(svg, (1000, 400)).into_drawing_area();
    root.fill(&WHITE).map_err(draw)?;
    let (left, right) = root.split_horizontally(500);
    let colors = [RGBColor(170, 170, 170), BLUE, RED, GREEN];
    for (area, series, title, top) in [
        (&left, &loss, "loss", max_loss.max(1e-3) * 1.05),
        (&right, &acc, "accuracy", 1.0),
    ] {
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(45)
            .build_cartesian_2d(0.0..last_step, 0.0..top)
            .map_err(draw)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .x_labels(last_step.min(10.0) as usize + 1)
            .x_label_formatter(&|x| format!("{}", x.round() as i64))
            .draw()
            .map_err(draw)?;
        for (s, points) in series.iter().enumerate() {
            if points.is_empty() {
                continue;
            }
            let c = colors[s];
            // The step records: a thin line under the evaluations' lines and points.
            let (width, dots) = if s == 0 { (1, 0) } else { (2, 3) };
            chart
                .draw_series(LineSeries::new(
                    points.iter().copied(),
                    c.stroke_width(width),
                ))
                .map_err(draw)?
                .label(splits[s])
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], c));
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, dots, c.filled())))
                .map_err(draw)?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(draw)?;
    }
    root.present().map_err(draw)?;
    Ok(())
}

fn draw<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing the curves: {e:?}")
}
