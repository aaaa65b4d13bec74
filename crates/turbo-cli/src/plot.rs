//! `turbo eval-kv --plot`: quality against KV budget, one line per policy, as a PNG.
//!
//! A run's rows are hundreds of numbers; the plot shows at a glance how each policy's quality
//! falls with the budget, and goes into the docs. The means are computed by [`means`], apart
//! from the drawing, so that they can be tested on hand-made rows.
//!
//! Text is drawn with DejaVu Sans embedded in the binary (`assets/`), through plotters'
//! `ab_glyph` feature: its `ttf` feature would look fonts up with fontconfig, which a bare CI
//! machine has no fonts for. The glyphs themselves are placed by [`Canvas`], since plotters
//! 0.3.7's `ab_glyph` text drops each glyph's side bearing.

use crate::eval_kv::Row;
use ab_glyph::{Font, FontRef, ScaleFont};
use anyhow::{anyhow, bail, ensure, Context, Result};
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
// Not BackendStyle: in scope, its `stroke_width` would clash with `Color`'s.
use plotters_backend::{BackendColor, BackendCoord, BackendTextStyle, DrawingErrorKind};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

/// One policy at one budget: means over the texts that have it.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    pub budget: f64,
    /// How many texts the means are over.
    pub texts: usize,
    /// Perplexity over full attention's on the same text, minus one, in percent.
    pub ppl_vs_full: f64,
    pub greedy_agree: f64,
    /// Only where every row of the point has one (`--task summarize`).
    pub rouge_l: Option<f64>,
}

/// One policy's points, by rising budget.
#[derive(Clone, Debug, PartialEq)]
pub struct Curve {
    pub policy: String,
    pub points: Vec<Point>,
}

/// What a plot shows: every policy but full attention, which is the reference of each text.
#[derive(Clone, Debug, PartialEq)]
pub struct Means {
    pub task: String,
    /// Texts with a full-attention row.
    pub texts: usize,
    /// In the order the policies first appear in the rows.
    pub curves: Vec<Curve>,
}

/// The name full attention's rows have; they are the reference of their text.
pub const FULL: &str = "full";

/// Means over the texts of each (policy, budget), each text's perplexity taken relative to
/// full attention's on that text (a ratio, as the docs' tables give it, since texts' own
/// perplexities differ tenfold). Errors on rows that cannot be compared: none, several tasks,
/// a text without exactly one full-attention row.
pub fn means(rows: &[Row]) -> Result<Means> {
    let first = rows.first().context("there are no rows to plot")?;
    if let Some(other) = rows.iter().find(|r| r.task != first.task) {
        bail!(
            "the rows mix tasks {} and {}: plot one task at a time",
            first.task,
            other.task
        );
    }
    let mut full: BTreeMap<&str, &Row> = BTreeMap::new();
    for row in rows.iter().filter(|r| r.policy == FULL) {
        ensure!(
            full.insert(&row.text, row).is_none(),
            "text {} has more than one full-attention row (policy \"{FULL}\"): one run's rows \
             at a time",
            row.text
        );
        ensure!(
            row.ppl.is_finite() && row.ppl > 0.0,
            "text {}: full attention's perplexity is {}",
            row.text,
            row.ppl
        );
    }
    ensure!(
        !full.is_empty(),
        "no full-attention rows (policy \"{FULL}\"): they are the reference that the other \
         policies are compared with"
    );
    let mut order: Vec<&str> = Vec::new();
    // Per policy, per budget (as bits, since f64 is not Ord): the rows.
    let mut groups: BTreeMap<&str, BTreeMap<u64, Vec<&Row>>> = BTreeMap::new();
    for row in rows.iter().filter(|r| r.policy != FULL) {
        ensure!(
            full.contains_key(row.text.as_str()),
            "text {} has no full-attention row (policy \"{FULL}\") to compare {} with",
            row.text,
            row.policy
        );
        ensure!(
            row.budget.is_finite(),
            "text {}, policy {}: budget {}",
            row.text,
            row.policy,
            row.budget
        );
        if !order.contains(&row.policy.as_str()) {
            order.push(&row.policy);
        }
        groups
            .entry(&row.policy)
            .or_default()
            .entry(row.budget.to_bits())
            .or_default()
            .push(row);
    }
    let curves = order
        .into_iter()
        .map(|policy| {
            let mut points: Vec<Point> = groups[policy]
                .iter()
                .map(|(&bits, group)| {
                    let n = group.len() as f64;
                    let mean =
                        |f: &dyn Fn(&Row) -> f64| group.iter().map(|r| f(r)).sum::<f64>() / n;
                    Point {
                        budget: f64::from_bits(bits),
                        texts: group.len(),
                        ppl_vs_full: mean(&|r| (r.ppl / full[r.text.as_str()].ppl - 1.0) * 100.0),
                        greedy_agree: mean(&|r| r.greedy_agree),
                        rouge_l: group
                            .iter()
                            .all(|r| r.rouge_l.is_some())
                            .then(|| mean(&|r| r.rouge_l.unwrap_or(0.0))),
                    }
                })
                .collect();
            points.sort_by(|a, b| a.budget.total_cmp(&b.budget));
            Curve {
                policy: policy.to_string(),
                points,
            }
        })
        .collect::<Vec<Curve>>();
    // A perplexity beyond f64's range (written as null), or a ratio that overflows, has no
    // place on an axis.
    for curve in &curves {
        for p in &curve.points {
            ensure!(
                p.ppl_vs_full.is_finite() && p.greedy_agree.is_finite(),
                "policy {} at budget {}: perplexity against full attention's is {}%, greedy \
                 agreement {}: not plottable",
                curve.policy,
                p.budget,
                p.ppl_vs_full,
                p.greedy_agree
            );
        }
    }
    Ok(Means {
        task: first.task.clone(),
        texts: full.len(),
        curves,
    })
}

/// The title of a plot: the task and text count from the rows, and `source`, which says where
/// they come from (a model and N/K for a run, the file for `--from-json`), since rows hold
/// neither.
pub fn caption(means: &Means, source: &str) -> String {
    let texts = match means.texts {
        1 => "1 text".to_string(),
        n => format!("{n} texts"),
    };
    format!(
        "KV eviction against full attention: {} task, means over {texts} ({source})",
        means.task
    )
}

/// The PNG's size in pixels: two panels side by side for `continue`, one for `summarize`.
pub fn size(task: &str) -> (u32, u32) {
    if task == "summarize" {
        (900, 620)
    } else {
        (1500, 620)
    }
}

/// Checks that `path` can be written, before an evaluation that takes minutes is started
/// rather than after: it names a .png (the format follows the extension) in a directory that
/// exists, and is writable. Creates nothing that it does not remove.
pub fn check_writable(path: &Path) -> Result<()> {
    let shown = path.display();
    ensure!(
        path.extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("png")),
        "--plot {shown}: the plot is a PNG, so its file name must end in .png"
    );
    crate::output::check_writable("--plot", path)
}

const FONT_FAMILY: &str = "sans-serif";
static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// Loads the embedded font and registers it once for the process: plotters' `ab_glyph` text
/// measures only fonts registered by name, and [`Canvas`] draws with the one returned.
fn font() -> Result<FontRef<'static>> {
    static LOADED: OnceLock<Option<FontRef<'static>>> = OnceLock::new();
    let font = LOADED.get_or_init(|| {
        plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, FONT).ok()?;
        FontRef::try_from_slice(FONT).ok()
    });
    font.clone()
        .context("the embedded font (DejaVu Sans) does not load")
}

/// A bitmap backend that draws text itself. plotters 0.3.7's `ab_glyph` text puts each glyph
/// at its advance without its left side bearing, which spaces letters unevenly ("m ean"); here
/// each glyph is rasterized at its own position. Layout (sizes, anchors, rotation) is plotters'.
struct Canvas<'a> {
    inner: BitMapBackend<'a>,
    font: FontRef<'static>,
}

type CanvasResult<T> =
    std::result::Result<T, DrawingErrorKind<<BitMapBackend<'static> as DrawingBackend>::ErrorType>>;

impl DrawingBackend for Canvas<'_> {
    type ErrorType = <BitMapBackend<'static> as DrawingBackend>::ErrorType;

    fn get_size(&self) -> (u32, u32) {
        self.inner.get_size()
    }
    fn ensure_prepared(&mut self) -> CanvasResult<()> {
        self.inner.ensure_prepared()
    }
    fn present(&mut self) -> CanvasResult<()> {
        self.inner.present()
    }
    fn draw_pixel(&mut self, point: BackendCoord, color: BackendColor) -> CanvasResult<()> {
        self.inner.draw_pixel(point, color)
    }
    fn draw_line<S: plotters_backend::BackendStyle>(
        &mut self,
        from: BackendCoord,
        to: BackendCoord,
        style: &S,
    ) -> CanvasResult<()> {
        self.inner.draw_line(from, to, style)
    }
    fn draw_rect<S: plotters_backend::BackendStyle>(
        &mut self,
        upper_left: BackendCoord,
        bottom_right: BackendCoord,
        style: &S,
        fill: bool,
    ) -> CanvasResult<()> {
        self.inner.draw_rect(upper_left, bottom_right, style, fill)
    }
    fn draw_path<S: plotters_backend::BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        path: I,
        style: &S,
    ) -> CanvasResult<()> {
        self.inner.draw_path(path, style)
    }
    fn draw_circle<S: plotters_backend::BackendStyle>(
        &mut self,
        center: BackendCoord,
        radius: u32,
        style: &S,
        fill: bool,
    ) -> CanvasResult<()> {
        self.inner.draw_circle(center, radius, style, fill)
    }
    fn fill_polygon<S: plotters_backend::BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        vert: I,
        style: &S,
    ) -> CanvasResult<()> {
        self.inner.fill_polygon(vert, style)
    }
    fn blit_bitmap(&mut self, pos: BackendCoord, size: (u32, u32), src: &[u8]) -> CanvasResult<()> {
        self.inner.blit_bitmap(pos, size, src)
    }

    /// plotters-backend's default `draw_text`, with the glyphs placed by their outline bounds.
    fn draw_text<S: BackendTextStyle>(
        &mut self,
        text: &str,
        style: &S,
        pos: BackendCoord,
    ) -> CanvasResult<()> {
        let color = style.color();
        if color.alpha == 0.0 {
            return Ok(());
        }
        let ((min_x, min_y), (max_x, max_y)) = style
            .layout_box(text)
            .map_err(|e| DrawingErrorKind::FontError(Box::new(e)))?;
        let (width, height) = (max_x - min_x, max_y - min_y);
        let anchor = style.anchor();
        let dx = match anchor.h_pos {
            HPos::Left => 0,
            HPos::Right => -width,
            HPos::Center => -width / 2,
        } - min_x;
        let dy = match anchor.v_pos {
            VPos::Top => 0,
            VPos::Center => -height / 2,
            VPos::Bottom => -height,
        } - min_y;
        let transform = style.transform();
        let (w, h) = self.get_size();
        let size = style.size() as f32;
        let font = self.font.as_scaled(size);
        let (mut x, mut prev) = (0f32, None);
        for c in text.chars() {
            let id = font.glyph_id(c);
            if let Some(prev) = prev {
                x += font.kern(prev, id);
            }
            prev = Some(id);
            let glyph = id.with_scale_and_position(size, ab_glyph::point(x, 0.0));
            x += font.h_advance(id);
            let Some(outline) = font.outline_glyph(glyph) else {
                continue;
            };
            let bounds = outline.px_bounds();
            // The baseline at half the size down from the top, as plotters' own text has it.
            let (gx, gy) = (bounds.min.x as i32, (size / 2.0 + bounds.min.y) as i32);
            let mut pixels = Vec::new();
            outline.draw(|px, py, a| pixels.push((px as i32, py as i32, a)));
            for (px, py, a) in pixels {
                let (tx, ty) = transform.transform(gx + px + dx, gy + py + dy);
                let (tx, ty) = (pos.0 + tx, pos.1 + ty);
                if tx >= 0 && tx < w as i32 && ty >= 0 && ty < h as i32 {
                    self.inner.draw_pixel((tx, ty), color.mix(f64::from(a)))?;
                }
            }
        }
        Ok(())
    }
}

/// Draws `means` under `caption` into the PNG `path`: for `continue`, perplexity over full
/// attention's and greedy agreement against budget; for `summarize`, ROUGE-L. Full attention
/// is the dashed reference line.
pub fn render(means: &Means, caption: &str, path: &Path) -> Result<()> {
    let font = font()?;
    let panels = match means.task.as_str() {
        "summarize" => {
            ensure!(
                means
                    .curves
                    .iter()
                    .all(|c| c.points.iter().all(|p| p.rouge_l.is_some())),
                "summarize rows without rouge_l: nothing to plot"
            );
            vec![Panel {
                title: "summary ROUGE-L against full attention's (mean over texts)",
                y_desc: "ROUGE-L F1",
                value: |p| p.rouge_l.unwrap_or(0.0),
                reference: 1.0,
                percent: false,
                clip_outliers: false,
            }]
        }
        "continue" => vec![
            Panel {
                title: "perplexity vs full attention (mean over texts, %)",
                y_desc: "perplexity over full attention's",
                value: |p| p.ppl_vs_full,
                reference: 0.0,
                percent: true,
                clip_outliers: true,
            },
            Panel {
                title: "greedy agreement with full attention",
                y_desc: "share of steps with full attention's top token",
                value: |p| p.greedy_agree,
                reference: 1.0,
                percent: false,
                clip_outliers: false,
            },
        ],
        other => bail!("task {other}: eval-kv's tasks are continue and summarize"),
    };
    let size = size(&means.task);
    let root = Canvas {
        inner: BitMapBackend::new(path, size),
        font,
    }
    .into_drawing_area();
    draw(&root, means, caption, &panels)
        .and_then(|()| root.present().map_err(|e| anyhow!("{e}")))
        .with_context(|| format!("cannot draw the plot {}", path.display()))
}

/// One chart: a value of each point against budget.
struct Panel {
    title: &'static str,
    y_desc: &'static str,
    value: fn(&Point) -> f64,
    /// Full attention's value.
    reference: f64,
    /// Labels as "+5%" rather than "0.85".
    percent: bool,
    /// Lets policies far above all the others go off the top (drawn as markers with their
    /// values), so that the others' differences stay readable.
    clip_outliers: bool,
}

const GRID: RGBColor = RGBColor(215, 215, 215);

/// The colour of a policy: fixed for eval-kv's own so that plots compare, cycled for others.
fn color(policy: &str, index: usize) -> RGBColor {
    const OTHERS: [RGBColor; 4] = [
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    match policy {
        "keyformer" => RGBColor(31, 119, 180),
        "h2o" => RGBColor(255, 127, 14),
        "sink" => RGBColor(44, 160, 44),
        "window" => RGBColor(214, 39, 40),
        _ => OTHERS[index % OTHERS.len()],
    }
}

type Area<'a> = DrawingArea<Canvas<'a>, Shift>;

fn draw(root: &Area, means: &Means, caption: &str, panels: &[Panel]) -> Result<()> {
    let err = |e: DrawingAreaErrorKind<_>| anyhow!("{e}");
    root.fill(&WHITE).map_err(err)?;
    // The title, wrapped to the width: a file name can make it long.
    let font = (FONT_FAMILY, 22).into_font().color(&BLACK);
    let (width, _) = root.dim_in_pixel();
    let fits = |line: &str| {
        root.estimate_text_size(line, &font)
            .map_or(true, |(w, _)| w + 24 <= width)
    };
    let mut lines: Vec<String> = Vec::new();
    for word in caption.split(' ') {
        match lines.last_mut() {
            Some(line) if fits(&format!("{line} {word}")) => {
                line.push(' ');
                line.push_str(word);
            }
            _ => lines.push(word.to_string()),
        }
    }
    const LINE_HEIGHT: u32 = 28;
    let (title, body) = root.split_vertically(LINE_HEIGHT * lines.len() as u32 + 10);
    for (i, line) in lines.iter().enumerate() {
        title
            .draw(&Text::new(
                line.as_str(),
                ((width / 2) as i32, (6 + LINE_HEIGHT * i as u32) as i32),
                font.pos(Pos::new(HPos::Center, VPos::Top)),
            ))
            .map_err(err)?;
    }
    let (charts, legend) = body.split_vertically(body.dim_in_pixel().1.saturating_sub(44));
    let mut off_scale = Vec::new();
    for (panel, area) in panels.iter().zip(charts.split_evenly((1, panels.len()))) {
        off_scale.extend(draw_panel(&area, means, panel)?);
    }
    draw_legend(&legend, means, &off_scale)
}

/// Draws one panel; returns the policies it drew off scale.
fn draw_panel(area: &Area, means: &Means, panel: &Panel) -> Result<Vec<String>> {
    let err = |e: DrawingAreaErrorKind<_>| anyhow!("{e}");
    // (budget, value) of each curve, by the curve's index.
    let series: Vec<Vec<(f64, f64)>> = means
        .curves
        .iter()
        .map(|c| {
            c.points
                .iter()
                .map(|p| (p.budget, (panel.value)(p)))
                .collect()
        })
        .collect();
    // Off scale: while the policy with the highest minimum is entirely above twice everything
    // else (window without sinks, at +70% where the rest are within +12%), it goes over the top.
    let mut shown: Vec<usize> = (0..series.len()).collect();
    let mut off: Vec<usize> = Vec::new();
    let min_of = |s: usize| series[s].iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let max_of = |s: usize| {
        series[s]
            .iter()
            .map(|p| p.1)
            .fold(f64::NEG_INFINITY, f64::max)
    };
    while panel.clip_outliers && shown.len() > 1 {
        let (pos, &top) = shown
            .iter()
            .enumerate()
            .max_by(|a, b| min_of(*a.1).total_cmp(&min_of(*b.1)))
            .expect("shown is not empty");
        let rest = shown
            .iter()
            .filter(|&&s| s != top)
            .map(|&s| max_of(s))
            .fold(panel.reference, f64::max);
        if min_of(top) > 2.0 * rest.max(1.0) {
            off.push(shown.remove(pos));
        } else {
            break;
        }
    }
    let values = shown
        .iter()
        .flat_map(|&s| series[s].iter().map(|p| p.1))
        .chain([panel.reference]);
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    ensure!(
        lo.is_finite() && hi.is_finite(),
        "{}: values from {lo} to {hi} cannot be plotted",
        panel.title
    );
    let span = if hi - lo > 0.0 && (hi - lo).is_finite() {
        hi - lo
    } else {
        1.0
    };
    let (y_lo, y_hi) = (
        lo - 0.06 * span,
        hi + if off.is_empty() { 0.08 } else { 0.22 } * span,
    );
    let budgets = means
        .curves
        .iter()
        .flat_map(|c| c.points.iter().map(|p| p.budget));
    let (b_lo, b_hi) = budgets.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), b| {
        (lo.min(b), hi.max(b))
    });
    let (x_lo, x_hi) = if b_lo.is_finite() && b_hi > b_lo {
        let pad = 0.06 * (b_hi - b_lo);
        (b_lo - pad, b_hi + pad)
    } else if b_lo.is_finite() {
        (b_lo - 0.1, b_lo + 0.1)
    } else {
        (0.0, 1.0)
    };

    let mut chart = ChartBuilder::on(area)
        .caption(panel.title, (FONT_FAMILY, 18))
        .margin(12)
        .margin_right(24)
        .x_label_area_size(48)
        .y_label_area_size(76)
        .build_cartesian_2d(x_lo..x_hi, y_lo..y_hi)
        .map_err(err)?;
    let percent = panel.percent;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .bold_line_style(GRID)
        .x_desc("KV budget (share of the prompt's keys kept)")
        .y_desc(panel.y_desc)
        .x_labels(10)
        .y_labels(10)
        .x_label_formatter(&|x| format!("{:.0}%", x * 100.0))
        .y_label_formatter(&|y| {
            if percent && y.abs() < 1e-9 {
                "0%".to_string()
            } else if percent {
                format!("{y:+.0}%")
            } else {
                format!("{y:.2}")
            }
        })
        .label_style((FONT_FAMILY, 14))
        .axis_desc_style((FONT_FAMILY, 15))
        .draw()
        .map_err(err)?;
    chart
        .draw_series(DashedLineSeries::new(
            [(x_lo, panel.reference), (x_hi, panel.reference)],
            8,
            5,
            BLACK.stroke_width(2),
        ))
        .map_err(err)?;
    for &s in &shown {
        let pts = &series[s];
        let c = color(&means.curves[s].policy, s);
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(3)))
            .map_err(err)?;
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 5, c.filled())))
            .map_err(err)?;
    }
    // Off-scale policies: a marker at the top of each budget, with the value under it.
    for (row, &s) in off.iter().enumerate() {
        let pts = &series[s];
        let c = color(&means.curves[s].policy, s);
        let y = y_hi - (0.04 + 0.07 * row as f64) * (y_hi - y_lo);
        let label_style = (FONT_FAMILY, 13)
            .into_font()
            .color(&c)
            .pos(Pos::new(HPos::Center, VPos::Top));
        chart
            .draw_series(pts.iter().map(|&(b, v)| {
                let label = if percent {
                    format!("{v:+.0}%")
                } else {
                    format!("{v:.2}")
                };
                EmptyElement::at((b, y))
                    + TriangleMarker::new((0, 0), 7, c.filled())
                    + Text::new(label, (0, 8), label_style.clone())
            }))
            .map_err(err)?;
    }
    Ok(off
        .iter()
        .map(|&s| means.curves[s].policy.clone())
        .collect())
}

/// A legend under the panels, for all of them: inside a panel it would hide lines.
fn draw_legend(area: &Area, means: &Means, off_scale: &[String]) -> Result<()> {
    let err = |e: DrawingAreaErrorKind<_>| anyhow!("{e}");
    let font = (FONT_FAMILY, 16).into_font().color(&BLACK);
    let mut entries: Vec<(String, RGBColor, bool)> =
        vec![("full attention (reference)".to_string(), BLACK, true)];
    for (i, c) in means.curves.iter().enumerate() {
        let name = if off_scale.contains(&c.policy) {
            format!("{} (▲ above the perplexity scale, value printed)", c.policy)
        } else {
            c.policy.clone()
        };
        entries.push((name, color(&c.policy, i), false));
    }
    const LINE: i32 = 34;
    const GAP: i32 = 8;
    const SPACING: i32 = 32;
    let widths: Vec<i32> = entries
        .iter()
        .map(|(name, _, _)| {
            area.estimate_text_size(name, &font)
                .map(|(w, _)| w as i32)
                .map_err(err)
        })
        .collect::<Result<_>>()?;
    let total: i32 =
        widths.iter().map(|w| LINE + GAP + w).sum::<i32>() + SPACING * (entries.len() as i32 - 1);
    let (w, h) = area.dim_in_pixel();
    let mut x = ((w as i32 - total) / 2).max(4);
    let y = h as i32 / 2;
    for ((name, c, dashed), width) in entries.iter().zip(widths) {
        if *dashed {
            area.draw(&DashedPathElement::new(
                [(x, y), (x + LINE, y)],
                8,
                5,
                c.stroke_width(2),
            ))
            .map_err(err)?;
        } else {
            area.draw(&PathElement::new(
                [(x, y), (x + LINE, y)],
                c.stroke_width(3),
            ))
            .map_err(err)?;
            area.draw(&Circle::new((x + LINE / 2, y), 5, c.filled()))
                .map_err(err)?;
        }
        area.draw(&Text::new(
            name.as_str(),
            (x + LINE + GAP, y),
            font.pos(Pos::new(HPos::Left, VPos::Center)),
        ))
        .map_err(err)?;
        x += LINE + GAP + width + SPACING;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(text: &str, policy: &str, budget: f64, ppl: f64, agree: f64) -> Row {
        Row {
            text: text.to_string(),
            task: "continue".to_string(),
            policy: policy.to_string(),
            budget,
            kv_tokens: 100,
            nll: ppl.ln(),
            ppl,
            greedy_agree: agree,
            rouge_l: None,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn means_are_over_texts_relative_to_full_attention() {
        let rows = vec![
            row("a", "full", 1.0, 10.0, 1.0),
            row("a", "h2o", 0.5, 11.0, 0.9),
            row("a", "h2o", 0.2, 15.0, 0.6),
            row("a", "sink", 0.5, 12.0, 0.8),
            row("b", "full", 1.0, 20.0, 1.0),
            row("b", "h2o", 0.2, 40.0, 0.4),
            row("b", "h2o", 0.5, 21.0, 0.7),
        ];
        let m = means(&rows).unwrap();
        assert_eq!(m.task, "continue");
        assert_eq!(m.texts, 2);
        // Full attention is the reference, not a curve; policies in order of appearance.
        let names: Vec<&str> = m.curves.iter().map(|c| c.policy.as_str()).collect();
        assert_eq!(names, ["h2o", "sink"]);
        let h2o = &m.curves[0].points;
        assert_eq!(h2o.len(), 2);
        // Budgets rise; 0.2: a +50%, b +100%; 0.5: a +10%, b +5%.
        assert_eq!((h2o[0].budget, h2o[0].texts), (0.2, 2));
        assert!(close(h2o[0].ppl_vs_full, 75.0), "{:?}", h2o[0]);
        assert!(close(h2o[0].greedy_agree, 0.5));
        assert_eq!(h2o[1].budget, 0.5);
        assert!(close(h2o[1].ppl_vs_full, 7.5), "{:?}", h2o[1]);
        assert!(close(h2o[1].greedy_agree, 0.8));
        assert_eq!(h2o[1].rouge_l, None);
        // A text that only one policy ran on counts once.
        let sink = &m.curves[1].points;
        assert_eq!(sink[0].texts, 1);
        assert!(close(sink[0].ppl_vs_full, 20.0));

        // Each text's own full attention row is its reference.
        let mut moved = rows.clone();
        moved[4].ppl = 40.0;
        let m = means(&moved).unwrap();
        // 0.5: a +10%, b 21/40 - 1 = -47.5%.
        assert!(close(
            m.curves[0].points[1].ppl_vs_full,
            (10.0 - 47.5) / 2.0
        ));
    }

    #[test]
    fn summarize_means_carry_rouge_l() {
        let mut rows = vec![
            row("a", "full", 1.0, 3.0, 1.0),
            row("a", "window", 0.3, 4.0, 1.0),
            row("b", "full", 1.0, 3.0, 1.0),
            row("b", "window", 0.3, 4.0, 1.0),
        ];
        for (r, rouge) in rows.iter_mut().zip([1.0, 0.2, 1.0, 0.4]) {
            r.task = "summarize".to_string();
            r.rouge_l = Some(rouge);
        }
        let m = means(&rows).unwrap();
        assert_eq!(m.task, "summarize");
        let p = &m.curves[0].points[0];
        assert!(close(p.rouge_l.unwrap(), 0.3), "{p:?}");
    }

    #[test]
    fn rows_that_cannot_be_compared_are_errors() {
        let msg = |rows: &[Row]| format!("{:#}", means(rows).unwrap_err());
        assert!(msg(&[]).contains("no rows"));
        let no_full = [row("a", "h2o", 0.5, 11.0, 0.9)];
        assert!(
            msg(&no_full).contains("no full-attention rows"),
            "{}",
            msg(&no_full)
        );
        let other_text = [
            row("a", "full", 1.0, 10.0, 1.0),
            row("b", "h2o", 0.5, 11.0, 0.9),
        ];
        assert!(msg(&other_text).contains("text b has no full-attention row"));
        let twice = [
            row("a", "full", 1.0, 10.0, 1.0),
            row("a", "full", 1.0, 10.0, 1.0),
        ];
        assert!(msg(&twice).contains("more than one"));
        let mut mixed = vec![
            row("a", "full", 1.0, 10.0, 1.0),
            row("a", "h2o", 0.5, 11.0, 0.9),
        ];
        mixed[1].task = "summarize".to_string();
        assert!(msg(&mixed).contains("mix tasks"));
        // Perplexities whose ratio leaves f64's range (a run whose NLL overflowed writes its
        // perplexity as null, read back as infinity) are refused, not drawn on an endless axis.
        for ppl in [1e307, f64::INFINITY] {
            let huge = [
                row("a", "full", 1.0, 1.0, 1.0),
                row("a", "window", 0.5, ppl, 0.5),
            ];
            assert!(msg(&huge).contains("not plottable"), "{}", msg(&huge));
        }
        let null: crate::eval_kv::Row = serde_json::from_str(
            r#"{"text":"a","task":"continue","policy":"h2o","budget":0.5,"kv_tokens":1,"nll":1e300,"ppl":null,"greedy_agree":0.5}"#,
        )
        .unwrap();
        assert_eq!(null.ppl, f64::INFINITY);
    }

    /// Width and height from a PNG's header: the 8-byte signature, then the IHDR chunk
    /// (length, "IHDR", width, height as big-endian u32s).
    fn png_size(bytes: &[u8]) -> (u32, u32) {
        assert!(bytes.len() > 24, "{} bytes", bytes.len());
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
        assert_eq!(&bytes[12..16], b"IHDR");
        let be = |i: usize| u32::from_be_bytes(bytes[i..i + 4].try_into().unwrap());
        (be(16), be(20))
    }

    #[test]
    fn renders_a_png_of_the_expected_size() {
        let dir = tempfile::tempdir().unwrap();
        let rows = vec![
            row("a", "full", 1.0, 10.0, 1.0),
            row("a", "keyformer", 0.2, 11.5, 0.85),
            row("a", "keyformer", 0.5, 10.2, 0.93),
            row("a", "window", 0.2, 20.0, 0.6),
            row("a", "window", 0.5, 18.0, 0.6),
        ];
        let m = means(&rows).unwrap();
        let path = dir.path().join("quality.png");
        check_writable(&path).unwrap();
        assert!(!path.exists(), "the check leaves no file behind");
        render(&m, &caption(&m, "test rows"), &path).unwrap();
        assert_eq!(png_size(&std::fs::read(&path).unwrap()), size("continue"));

        let summarize: Vec<Row> = rows
            .into_iter()
            .map(|mut r| {
                r.task = "summarize".to_string();
                r.rouge_l = Some(r.greedy_agree);
                r
            })
            .collect();
        let m = means(&summarize).unwrap();
        let path = dir.path().join("summary.png");
        render(&m, &caption(&m, "test rows"), &path).unwrap();
        assert_eq!(png_size(&std::fs::read(&path).unwrap()), size("summarize"));
    }

    #[test]
    fn unwritable_plot_paths_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let msg = |p: &Path| format!("{:#}", check_writable(p).unwrap_err());
        assert!(msg(&dir.path().join("missing/q.png")).contains("does not exist"));
        assert!(msg(&dir.path().join("q.svg")).contains(".png"));
        let sub = dir.path().join("d.png");
        std::fs::create_dir(&sub).unwrap();
        assert!(msg(&sub).contains("is a directory"));
    }
}
