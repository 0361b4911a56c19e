//! Small PNG plots with plotters' bitmap backend and no system libraries: line charts and
//! heatmaps, labelled with the public-domain 8×8 bitmap font of the `font8x8` crate (plotters'
//! own text needs fontconfig/freetype or a font file).

use std::path::Path;

use anyhow::Result;
use font8x8::UnicodeFonts;
use plotters::coord::Shift;
use plotters::prelude::*;

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

/// Black, then ten colours that stay apart from each other (Tableau 10).
pub const PALETTE: [RGBColor; 11] = [
    RGBColor(0, 0, 0),
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Draws `s` with its top-left corner at `(x, y)`, each font pixel `scale` screen pixels.
fn text(area: &Area, x: i32, y: i32, s: &str, color: &RGBColor, scale: i32) -> Result<()> {
    for (i, ch) in s.chars().enumerate() {
        let glyph = font8x8::BASIC_FONTS
            .get(ch)
            .or_else(|| font8x8::BASIC_FONTS.get('?'))
            .unwrap_or([0; 8]);
        for (row, bits) in glyph.iter().enumerate() {
            for col in 0..8 {
                if bits & (1 << col) != 0 {
                    let px = x + (i as i32 * 8 + col) * scale;
                    let py = y + row as i32 * scale;
                    for dy in 0..scale {
                        for dx in 0..scale {
                            area.draw_pixel((px + dx, py + dy), color)?;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Width in pixels of `s` at `scale`.
fn text_width(s: &str, scale: i32) -> i32 {
    s.chars().count() as i32 * 8 * scale
}

/// A perceptually ordered colour ramp (dark blue → teal → yellow) for `v` in `[0, 1]`.
pub fn ramp(v: f64) -> RGBColor {
    const STOPS: [(f64, f64, f64); 5] = [
        (68.0, 1.0, 84.0),
        (59.0, 82.0, 139.0),
        (33.0, 145.0, 140.0),
        (94.0, 201.0, 98.0),
        (253.0, 231.0, 37.0),
    ];
    let v = v.clamp(0.0, 1.0) * (STOPS.len() - 1) as f64;
    let i = (v.floor() as usize).min(STOPS.len() - 2);
    let f = v - i as f64;
    let (a, b) = (STOPS[i], STOPS[i + 1]);
    let mix = |x: f64, y: f64| (x + (y - x) * f).round() as u8;
    RGBColor(mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

/// A short decimal for tick labels.
fn tick(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// What a chart says about itself.
pub struct Labels<'a> {
    /// Title, drawn on top.
    pub title: &'a str,
    /// Horizontal axis.
    pub x: &'a str,
    /// Vertical axis.
    pub y: &'a str,
}

/// A line chart of `series` (name, points) with a legend on the right, ticked at `x_ticks`.
/// With `log2_x` the horizontal axis is logarithmic.
pub fn line_chart(
    path: &Path,
    size: (u32, u32),
    labels: &Labels,
    series: &[(String, Vec<(f64, f64)>)],
    x_ticks: &[f64],
    log2_x: bool,
) -> Result<()> {
    line_chart_with_bars(path, size, labels, series, &[], x_ticks, log2_x)
}

/// [`line_chart`] with a vertical bar from `lo` to `hi` at each point: `bars[i][j] = (lo, hi)`
/// belongs to point `j` of series `i` (series without bars may be left out at the end).
pub fn line_chart_with_bars(
    path: &Path,
    size: (u32, u32),
    labels: &Labels,
    series: &[(String, Vec<(f64, f64)>)],
    bars: &[Vec<(f64, f64)>],
    x_ticks: &[f64],
    log2_x: bool,
) -> Result<()> {
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE)?;
    let (w, h) = (size.0 as i32, size.1 as i32);
    let legend_w = series
        .iter()
        .map(|(n, _)| text_width(n, 1) + 30)
        .max()
        .unwrap_or(0);
    let (left, right, top, bottom) = (56, w - legend_w - 16, 40, h - 40);
    let fx = |x: f64| if log2_x { x.log2() } else { x };
    let points = series.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in points {
        x0 = x0.min(fx(x));
        x1 = x1.max(fx(x));
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    for &(lo, hi) in bars.iter().flatten() {
        y0 = y0.min(lo);
        y1 = y1.max(hi);
    }
    if x0 >= x1 {
        x1 = x0 + 1.0;
    }
    if y0 >= y1 {
        y1 = y0 + 1.0;
    }
    let pad = (y1 - y0) * 0.05;
    let (y0, y1) = (y0 - pad, y1 + pad);
    let px = |x: f64| left + ((fx(x) - x0) / (x1 - x0) * (right - left) as f64).round() as i32;
    let py = |y: f64| bottom - ((y - y0) / (y1 - y0) * (bottom - top) as f64).round() as i32;
    let grey = RGBColor(220, 220, 220);
    let ink = RGBColor(40, 40, 40);
    // Horizontal grid and y ticks: six evenly spaced values.
    for i in 0..=5 {
        let y = y0 + (y1 - y0) * i as f64 / 5.0;
        root.draw(&PathElement::new(vec![(left, py(y)), (right, py(y))], grey))?;
        let label = tick((y * 100.0).round() / 100.0);
        text(
            &root,
            left - 6 - text_width(&label, 1),
            py(y) - 4,
            &label,
            &ink,
            1,
        )?;
    }
    for &x in x_ticks {
        root.draw(&PathElement::new(vec![(px(x), top), (px(x), bottom)], grey))?;
        let label = tick(x);
        text(
            &root,
            px(x) - text_width(&label, 1) / 2,
            bottom + 6,
            &label,
            &ink,
            1,
        )?;
    }
    root.draw(&PathElement::new(
        vec![(left, top), (left, bottom), (right, bottom)],
        ink,
    ))?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let style = ShapeStyle::from(&color).stroke_width(2);
        let line: Vec<(i32, i32)> = pts.iter().map(|&(x, y)| (px(x), py(y))).collect();
        root.draw(&PathElement::new(line.clone(), style))?;
        if line.len() <= 16 {
            for &p in &line {
                root.draw(&Circle::new(p, 3, color.filled()))?;
            }
        }
        for (&(x, _), &(lo, hi)) in pts.iter().zip(bars.get(i).into_iter().flatten()) {
            root.draw(&PathElement::new(
                vec![(px(x), py(lo)), (px(x), py(hi))],
                style,
            ))?;
            for y in [lo, hi] {
                root.draw(&PathElement::new(
                    vec![(px(x) - 3, py(y)), (px(x) + 3, py(y))],
                    style,
                ))?;
            }
        }
        let ly = top + 4 + i as i32 * 14;
        root.draw(&PathElement::new(
            vec![(right + 12, ly + 3), (right + 30, ly + 3)],
            style,
        ))?;
        text(&root, right + 34, ly, name, &ink, 1)?;
    }
    text(&root, left, 6, labels.title, &ink, 1)?;
    let xl = labels.x;
    text(
        &root,
        (left + right - text_width(xl, 1)) / 2,
        h - 16,
        xl,
        &ink,
        1,
    )?;
    text(&root, 4, top - 16, labels.y, &ink, 1)?;
    root.present()?;
    Ok(())
}

/// A heatmap of `values[row][col]` (rows top to bottom), each cell `cell` pixels, coloured by
/// [`ramp`] between the smallest and largest value, with a colour bar labelled by both.
pub fn heatmap(path: &Path, labels: &Labels, values: &[Vec<f64>], cell: u32) -> Result<()> {
    let rows = values.len() as u32;
    let cols = values.first().map_or(0, Vec::len) as u32;
    let (left, top) = (40i32, 28i32);
    let w = left as u32 + cols * cell + 110;
    let h = top as u32 + rows * cell + 36;
    let root = BitMapBackend::new(path, (w, h)).into_drawing_area();
    root.fill(&WHITE)?;
    let all = values.iter().flatten().copied();
    let (lo, hi) = all.fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
    let span = if hi > lo { hi - lo } else { 1.0 };
    let c = cell as i32;
    for (r, row) in values.iter().enumerate() {
        for (k, v) in row.iter().enumerate() {
            let (x, y) = (left + k as i32 * c, top + r as i32 * c);
            let color = ramp((v - lo) / span);
            root.draw(&Rectangle::new([(x, y), (x + c, y + c)], color.filled()))?;
        }
    }
    let ink = RGBColor(40, 40, 40);
    // Colour bar.
    let bx = left + cols as i32 * c + 16;
    let bh = rows as i32 * c;
    for i in 0..bh {
        let color = ramp(1.0 - i as f64 / (bh - 1).max(1) as f64);
        root.draw(&Rectangle::new(
            [(bx, top + i), (bx + 12, top + i + 1)],
            color.filled(),
        ))?;
    }
    text(&root, bx + 16, top, &tick(hi), &ink, 1)?;
    text(&root, bx + 16, top + bh - 8, &tick(lo), &ink, 1)?;
    text(&root, left, 8, labels.title, &ink, 1)?;
    text(&root, left, top + bh + 10, labels.x, &ink, 1)?;
    // The vertical label, one character per line.
    for (i, ch) in labels.y.chars().enumerate() {
        text(&root, 12, top + i as i32 * 10, &ch.to_string(), &ink, 1)?;
    }
    root.present()?;
    Ok(())
}
