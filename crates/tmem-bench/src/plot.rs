//! Figures of the benchmarks as SVG (`plotters`): one line per backend over
//! the x values of the experiment, as the seeds draw them.

use std::path::Path;

use anyhow::anyhow;
use plotters::prelude::*;

/// One line of a figure: a name and its points (x, y); a missing y breaks it.
#[derive(Clone, Debug)]
pub struct Series {
    /// Legend.
    pub name: String,
    /// Points in x order.
    pub points: Vec<(f64, Option<f64>)>,
}

/// One panel: a title, axis labels and its lines.
#[derive(Clone, Debug)]
pub struct Panel {
    /// Title above the panel.
    pub title: String,
    /// Label of the x axis.
    pub x_label: String,
    /// Label of the y axis.
    pub y_label: String,
    /// Lines.
    pub series: Vec<Series>,
}

/// Draws `panels` side by side into an SVG file at `path`.
pub fn svg(path: &Path, caption: &str, panels: &[Panel]) -> anyhow::Result<()> {
    let width = 560 * u32::try_from(panels.len().max(1)).unwrap_or(1);
    let root = SVGBackend::new(path, (width, 460)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("plot: {e}"))?;
    let root = root.titled(caption, ("sans-serif", 18)).map_err(|e| anyhow!("plot: {e}"))?;
    for (area, panel) in root.split_evenly((1, panels.len().max(1))).iter().zip(panels) {
        draw_panel(area, panel)?;
    }
    root.present().map_err(|e| anyhow!("plot {}: {e}", path.display()))
}

fn draw_panel<DB: DrawingBackend>(area: &DrawingArea<DB, plotters::coord::Shift>, p: &Panel) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let xs = p.series.iter().flat_map(|s| s.points.iter().map(|(x, _)| *x));
    let ys = p.series.iter().flat_map(|s| s.points.iter().filter_map(|(_, y)| *y));
    let (x_min, x_max) = bounds(xs);
    let (_, y_max) = bounds(ys);
    let mut chart = ChartBuilder::on(area)
        .caption(&p.title, ("sans-serif", 15))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(52)
        .build_cartesian_2d(x_min..x_max, 0.0..y_max * 1.1)
        .map_err(|e| anyhow!("plot: {e}"))?;
    chart.configure_mesh().x_desc(&p.x_label).y_desc(&p.y_label).draw().map_err(|e| anyhow!("plot: {e}"))?;
    for (i, s) in p.series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        // A missing point (no correct run) breaks the line into segments.
        let mut segments: Vec<Vec<(f64, f64)>> = vec![Vec::new()];
        for &(x, y) in &s.points {
            match y {
                Some(y) => segments.last_mut().unwrap_or_else(|| unreachable!()).push((x, y)),
                None => segments.push(Vec::new()),
            }
        }
        let mut first = true;
        for seg in segments.into_iter().filter(|v| !v.is_empty()) {
            let line = chart
                .draw_series(LineSeries::new(seg.iter().copied(), color.stroke_width(2)))
                .map_err(|e| anyhow!("plot: {e}"))?;
            if first {
                line.label(s.name.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
                first = false;
            }
            chart
                .draw_series(seg.iter().map(|&(x, y)| Circle::new((x, y), 3, color.filled())))
                .map_err(|e| anyhow!("plot: {e}"))?;
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow!("plot: {e}"))?;
    Ok(())
}

/// Range of `v`, widened so that a single value or none still makes an axis.
fn bounds(v: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = v.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(x), hi.max(x)));
    if !lo.is_finite() || !hi.is_finite() {
        return (0.0, 1.0);
    }
    if (hi - lo).abs() < f64::EPSILON {
        return (lo - 1.0, hi + 1.0);
    }
    (lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_an_svg_with_every_series_and_a_gap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.svg");
        let s = |name: &str, ys: [Option<f64>; 3]| Series {
            name: name.into(),
            points: [100.0, 50.0, 25.0].into_iter().zip(ys).collect(),
        };
        let panel = Panel {
            title: "wall time".into(),
            x_label: "memory limit, % of peak".into(),
            y_label: "s".into(),
            series: vec![s("zram", [Some(10.0), Some(12.0), Some(20.0)]), s("tmem", [Some(10.0), None, Some(22.0)])],
        };
        svg(&path, "tmem bench pressure", &[panel.clone(), panel]).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("<svg") && text.contains("zram") && text.contains("tmem"), "{text}");
        assert!(text.contains("wall time") && text.contains("memory limit"), "{text}");
    }

    #[test]
    fn bounds_make_an_axis_of_anything() {
        assert_eq!(bounds([].into_iter()), (0.0, 1.0));
        assert_eq!(bounds([5.0].into_iter()), (4.0, 6.0));
        assert_eq!(bounds([3.0, 1.0, 2.0].into_iter()), (1.0, 3.0));
    }
}
