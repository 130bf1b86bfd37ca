//! Figures of the benchmarks (`plotters`): PNG, or SVG for a `.svg` path.
//! Line panels (one line per backend over the x values of the experiment,
//! as the seeds draw them) and bar panels (one bar per backend).
//!
//! Text is drawn with DejaVu Sans (Debian's `fonts-dejavu-core`), read at
//! run time: plotters' system-font lookup needs fontconfig, which we do not
//! want to link.

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

/// One panel of bars: a title, the y axis label, one bar per name.
#[derive(Clone, Debug)]
pub struct Bars {
    /// Title above the panel.
    pub title: String,
    /// Label of the y axis.
    pub y_label: String,
    /// (name, value), in the order drawn.
    pub bars: Vec<(String, f64)>,
}

/// A panel of a figure.
#[derive(Clone, Debug)]
pub enum Figure {
    /// Lines over x.
    Lines(Panel),
    /// Bars by name.
    Bars(Bars),
}

/// Where the font is looked for.
const FONTS: [&str; 2] = ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/TTF/DejaVuSans.ttf"];

/// Registers DejaVu Sans as plotters' "sans-serif" (once).
fn register_font() -> anyhow::Result<()> {
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let bytes = FONTS
            .iter()
            .find_map(|p| std::fs::read(p).ok())
            .ok_or_else(|| format!("no DejaVu Sans font at {} (install fonts-dejavu-core)", FONTS.join(" or ")))?;
        // plotters keeps the font for the life of the process.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| "DejaVu Sans is not a font plotters can read".to_owned())
    })
    .clone()
    .map_err(|e| anyhow!("plot: {e}"))
}

/// Draws `panels` side by side into `path`: SVG for `.svg`, else PNG.
pub fn draw(path: &Path, caption: &str, panels: &[Figure]) -> anyhow::Result<()> {
    register_font()?;
    let width = 640 * u32::try_from(panels.len().max(1)).unwrap_or(1);
    if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("svg")) {
        draw_on(SVGBackend::new(path, (width, 460)).into_drawing_area(), caption, panels)
    } else {
        draw_on(BitMapBackend::new(path, (width, 460)).into_drawing_area(), caption, panels)
    }
    .map_err(|e| anyhow!("plot {}: {e}", path.display()))
}

fn draw_on<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    caption: &str,
    panels: &[Figure],
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(|e| anyhow!("plot: {e}"))?;
    let root = root.titled(caption, ("sans-serif", 18)).map_err(|e| anyhow!("plot: {e}"))?;
    for (area, panel) in root.split_evenly((1, panels.len().max(1))).iter().zip(panels) {
        match panel {
            Figure::Lines(p) => draw_panel(area, p)?,
            Figure::Bars(b) => draw_bars(area, b)?,
        }
    }
    root.present().map_err(|e| anyhow!("{e}"))
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

fn draw_bars<DB: DrawingBackend>(area: &DrawingArea<DB, plotters::coord::Shift>, b: &Bars) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let names: Vec<String> = b.bars.iter().map(|(n, _)| n.clone()).collect();
    let (_, y_max) = bounds(b.bars.iter().map(|(_, v)| *v).chain([0.0]));
    let mut chart = ChartBuilder::on(area)
        .caption(&b.title, ("sans-serif", 15))
        .margin(12)
        .x_label_area_size(60)
        .y_label_area_size(52)
        .build_cartesian_2d(names.as_slice().into_segmented(), 0.0..y_max * 1.1)
        .map_err(|e| anyhow!("plot: {e}"))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .y_desc(&b.y_label)
        .x_label_style(("sans-serif", 10))
        .x_label_formatter(&|v| match v {
            SegmentValue::Exact(n) | SegmentValue::CenterOf(n) => (*n).clone(),
            SegmentValue::Last => String::new(),
        })
        .draw()
        .map_err(|e| anyhow!("plot: {e}"))?;
    for (i, (name, v)) in b.bars.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(SegmentValue::Exact(name), 0.0), (SegmentValue::CenterOf(name), *v)],
                color.filled(),
            )))
            .map_err(|e| anyhow!("plot: {e}"))?;
    }
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
        let bars = Bars {
            title: "ratio".into(),
            y_label: "x".into(),
            bars: vec![("zram lz4".into(), 1.7), ("tmem lz4".into(), 1.8)],
        };
        draw(&path, "tmem bench pressure", &[Figure::Lines(panel.clone()), Figure::Bars(bars)]).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("<svg") && text.contains("zram") && text.contains("tmem"), "{text}");
        assert!(text.contains("wall time") && text.contains("memory limit") && text.contains("tmem lz4"), "{text}");
        let png = dir.path().join("f.png");
        draw(&png, "tmem bench pressure", &[Figure::Lines(panel)]).unwrap();
        let bytes = std::fs::read(&png).unwrap();
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 4096, "{} bytes", bytes.len());
    }

    #[test]
    fn bounds_make_an_axis_of_anything() {
        assert_eq!(bounds([].into_iter()), (0.0, 1.0));
        assert_eq!(bounds([5.0].into_iter()), (4.0, 6.0));
        assert_eq!(bounds([3.0, 1.0, 2.0].into_iter()), (1.0, 3.0));
    }
}
