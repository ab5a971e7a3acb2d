//! The loss and accuracy curves of a run, drawn from its `metrics.jsonl` into an SVG: loss on
//! the left, accuracy on the right, one line per split (train, val, test) against the epoch.

use std::path::Path;

use anyhow::{Context, Result};
use plotters::prelude::*;

/// One split's (epoch, value) points.
type Series = Vec<(f64, f64)>;

/// Reads `metrics` (one JSON object per line with `epoch`, `split`, `loss`, `accuracy`) and
/// writes the curves to `svg`.
pub fn curves(metrics: &Path, svg: &Path) -> Result<()> {
    let text = std::fs::read_to_string(metrics)
        .with_context(|| format!("cannot read {}", metrics.display()))?;
    let splits = ["train", "val", "test"];
    let mut loss: Vec<Series> = vec![Vec::new(); splits.len()];
    let mut acc: Vec<Series> = vec![Vec::new(); splits.len()];
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{} line {}: not JSON", metrics.display(), i + 1))?;
        let field = |k: &str| {
            v.get(k)
                .and_then(|x| x.as_f64())
                .with_context(|| format!("{} line {}: no number `{k}`", metrics.display(), i + 1))
        };
        let split = v.get("split").and_then(|s| s.as_str()).unwrap_or("");
        if let Some(s) = splits.iter().position(|&n| n == split) {
            let epoch = field("epoch")?;
            loss[s].push((epoch, field("loss")?));
            acc[s].push((epoch, field("accuracy")?));
        }
    }
    let last_epoch = loss.iter().flatten().map(|p| p.0).fold(1.0f64, f64::max);
    let max_loss = loss
        .iter()
        .flatten()
        .map(|p| p.1)
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let root = SVGBackend::new(svg, (1000, 400)).into_drawing_area();
    root.fill(&WHITE).map_err(draw)?;
    let (left, right) = root.split_horizontally(500);
    let colors = [BLUE, RED, GREEN];
    for (area, series, title, top) in [
        (&left, &loss, "loss", max_loss.max(1e-3) * 1.05),
        (&right, &acc, "accuracy", 1.0),
    ] {
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(45)
            .build_cartesian_2d(1.0..last_epoch.max(1.0 + 1e-9), 0.0..top)
            .map_err(draw)?;
        chart
            .configure_mesh()
            .x_desc("epoch")
            .draw()
            .map_err(draw)?;
        for (s, points) in series.iter().enumerate() {
            if points.is_empty() {
                continue;
            }
            let c = colors[s];
            chart
                .draw_series(LineSeries::new(points.iter().copied(), c.stroke_width(2)))
                .map_err(draw)?
                .label(splits[s])
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], c));
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 3, c.filled())))
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
