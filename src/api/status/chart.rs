//! Charts for the status page, drawn on the server as inline SVG: no script, no library, no
//! style attribute (the page's CSP allows none; colours come from `status.css` classes), and a
//! text alternative for each: the SVG is an image named by its `<title>` and described by a
//! sentence in its `<desc>`, and a data table beside it holds every value.

use maud::{Markup, html};

/// Width of the drawing, in SVG units (it scales to its box).
const WIDTH: f64 = 600.0;
/// Height of the drawing.
const HEIGHT: f64 = 180.0;
/// Room on the left for the value axis's labels.
const LEFT: f64 = 72.0;
/// Room below for the time axis's labels.
const BOTTOM: f64 = 22.0;
/// Room above and to the right.
const MARGIN: f64 = 8.0;

/// What a chart's values are, for its axis and its table.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Unit<'a> {
    /// Bytes (shown as kB, MB, ... in powers of 1000).
    Bytes,
    /// Money in the currency named.
    Money(&'a str),
    /// A share from 0 to 1 (shown in percent, the axis always up to 100 %).
    Rate,
}

/// How the values are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// A bar per step (amounts per hour).
    Bars,
    /// A line through the steps with a value, broken where there is none (rates).
    Line,
}

/// One chart: a value (or none) per step of time.
#[derive(Debug, Clone)]
pub struct Chart<'a> {
    /// Unique on the page: the ids of its title, description and table derive from it.
    pub id: &'a str,
    /// What it shows, e.g. `Bytes per hour: team-a`.
    pub title: &'a str,
    /// What the values are.
    pub unit: Unit<'a>,
    /// How they are drawn.
    pub style: Style,
    /// The start of the first step, ms since the Unix epoch.
    pub from_ms: i64,
    /// The length of a step, in ms.
    pub step_ms: i64,
    /// A value per step, oldest first; `None`: nothing to show for that step.
    pub values: &'a [Option<f64>],
}

/// `value` as the unit shows it.
pub fn format_value(unit: Unit<'_>, value: f64) -> String {
    match unit {
        Unit::Bytes => format_bytes(value),
        Unit::Money(currency) => format!("{} {currency}", format_money(value)),
        Unit::Rate => format!("{:.0} %", value * 100.0),
    }
}

/// Bytes in powers of 1000 with three significant digits at most: `0 B`, `950 B`, `1.5 kB`.
pub fn format_bytes(bytes: f64) -> String {
    const UNITS: [&str; 7] = ["B", "kB", "MB", "GB", "TB", "PB", "EB"];
    let mut value = bytes.max(0.0);
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 || value >= 100.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else if value >= 10.0 {
        format!("{value:.1} {}", UNITS[unit])
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// Money with cents, and more digits for amounts below a cent: `12.34`, `0.0042`, `0`.
pub fn format_money(amount: f64) -> String {
    if amount == 0.0 {
        "0".to_owned()
    } else if amount.abs() >= 0.01 {
        format!("{amount:.2}")
    } else {
        format!("{amount:.6}").trim_end_matches('0').to_owned()
    }
}

/// The smallest "round" number (1, 2 or 5 × 10^n) at or above `max`; 1 for nothing above 0.
pub fn nice_ceiling(max: f64) -> f64 {
    if max.is_nan() || max <= 0.0 {
        return 1.0;
    }
    let magnitude = 10f64.powf(max.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|step| step * magnitude)
        .find(|candidate| *candidate >= max * (1.0 - 1e-12))
        .unwrap_or(10.0 * magnitude)
}

/// `ms` as `HH:MM` in UTC.
fn clock(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms)
        .map(|t| t.strftime("%H:%M").to_string())
        .unwrap_or_default()
}

/// The top of the value axis: 100 % for rates, else the round number above the largest value.
fn axis_top(chart: &Chart<'_>) -> f64 {
    match chart.unit {
        Unit::Rate => 1.0,
        _ => nice_ceiling(chart.values.iter().flatten().copied().fold(0.0, f64::max)),
    }
}

/// The sentence that describes the chart to a reader who cannot see it.
fn describe(chart: &Chart<'_>) -> String {
    let steps = chart.values.len();
    let from = clock(chart.from_ms);
    let to = clock(chart.from_ms + chart.step_ms * i64::try_from(steps).unwrap_or(0));
    let shown: Vec<(usize, f64)> = chart
        .values
        .iter()
        .enumerate()
        .filter_map(|(i, v)| v.map(|v| (i, v)))
        .collect();
    let Some(&(peak_at, peak)) = shown.iter().max_by(|a, b| a.1.total_cmp(&b.1)) else {
        return format!("No data from {from} to {to} UTC.");
    };
    let at = clock(chart.from_ms + chart.step_ms * i64::try_from(peak_at).unwrap_or(0));
    let summary = match chart.unit {
        Unit::Rate => {
            let mean = shown.iter().map(|(_, v)| v).sum::<f64>() / shown.len() as f64;
            format!("average {}", format_value(chart.unit, mean))
        }
        _ => {
            let total = shown.iter().map(|(_, v)| v).sum::<f64>();
            format!("total {}", format_value(chart.unit, total))
        }
    };
    format!(
        "From {from} to {to} UTC, {} of {steps} steps with data: {summary}, highest {} at {at}.",
        shown.len(),
        format_value(chart.unit, peak)
    )
}

/// The chart as an inline SVG figure with its data table.
pub fn chart(chart: &Chart<'_>) -> Markup {
    let title_id = format!("{}-title", chart.id);
    let desc_id = format!("{}-desc", chart.id);
    let labelled_by = format!("{title_id} {desc_id}");
    let top = axis_top(chart);
    let plot_width = WIDTH - LEFT - MARGIN;
    let plot_height = HEIGHT - BOTTOM - MARGIN;
    let base = HEIGHT - BOTTOM;
    let steps = chart.values.len().max(1) as f64;
    let slot = plot_width / steps;
    let y = |value: f64| base - (value / top).clamp(0.0, 1.0) * plot_height;
    let x = |i: usize| LEFT + slot * i as f64;
    let ticks = [0.0, top / 2.0, top];
    let last = chart.values.len().saturating_sub(1);
    let time_labels: Vec<(f64, String, &str)> = if chart.values.is_empty() {
        Vec::new()
    } else {
        let at = |i: usize| chart.from_ms + chart.step_ms * i64::try_from(i).unwrap_or(0);
        let mut labels = vec![(x(0), clock(at(0)), "start")];
        if last >= 2 {
            labels.push((x(last / 2) + slot / 2.0, clock(at(last / 2)), "middle"));
        }
        if last >= 1 {
            labels.push((x(last) + slot, clock(at(last + 1)), "end"));
        }
        labels
    };
    let has_data = chart.values.iter().any(Option::is_some);
    html! {
        figure.chart {
            svg viewBox=(format!("0 0 {WIDTH} {HEIGHT}")) role="img" aria-labelledby=(labelled_by)
                xmlns="http://www.w3.org/2000/svg" {
                title #(title_id) { (chart.title) }
                desc #(desc_id) { (describe(chart)) }
                @for tick in ticks {
                    line.grid x1=(LEFT) x2=(WIDTH - MARGIN) y1=(y(tick)) y2=(y(tick)) {}
                    text.axis x=(LEFT - 6.0) y=(y(tick) + 4.0) text-anchor="end" { (format_value(chart.unit, tick)) }
                }
                line.axis x1=(LEFT) x2=(LEFT) y1=(MARGIN) y2=(base) {}
                line.axis x1=(LEFT) x2=(WIDTH - MARGIN) y1=(base) y2=(base) {}
                @for (at, label, anchor) in &time_labels {
                    text.axis x=(at) y=(HEIGHT - 6.0) text-anchor=(anchor) { (label) }
                }
                @if !has_data {
                    text.empty x=(LEFT + plot_width / 2.0) y=(MARGIN + plot_height / 2.0) text-anchor="middle" { "No data" }
                } @else if chart.style == Style::Bars {
                    @for (i, value) in chart.values.iter().enumerate() {
                        @if let Some(value) = value.filter(|v| *v > 0.0) {
                            rect.bar x=(x(i) + slot * 0.1) y=(y(value)) width=(slot * 0.8) height=(base - y(value)) {}
                        }
                    }
                } @else {
                    @for run in runs(chart.values) {
                        @if run.len() == 1 {
                            circle.point cx=(x(run[0].0) + slot / 2.0) cy=(y(run[0].1)) r="3" {}
                        } @else {
                            polyline.line points=(run.iter().map(|(i, v)| format!("{},{}", x(*i) + slot / 2.0, y(*v))).collect::<Vec<_>>().join(" ")) {}
                        }
                    }
                }
            }
            details {
                summary { "Data of " (chart.title) }
                table {
                    thead { tr { th scope="col" { "From (UTC)" } th scope="col" { "Value" } } }
                    tbody {
                        @for (i, value) in chart.values.iter().enumerate() {
                            tr {
                                td { (clock(chart.from_ms + chart.step_ms * i64::try_from(i).unwrap_or(0))) }
                                td { (value.map_or_else(|| "—".to_owned(), |v| format_value(chart.unit, v))) }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The unbroken runs of steps with a value, as `(step, value)`.
fn runs(values: &[Option<f64>]) -> Vec<Vec<(usize, f64)>> {
    let mut runs: Vec<Vec<(usize, f64)>> = Vec::new();
    let mut current = Vec::new();
    for (i, value) in values.iter().enumerate() {
        match value {
            Some(v) => current.push((i, *v)),
            None if !current.is_empty() => runs.push(std::mem::take(&mut current)),
            None => {}
        }
    }
    if !current.is_empty() {
        runs.push(current);
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: i64 = 3_600_000;
    /// 2026-12-07 10:00 UTC.
    const TEN: i64 = 1_796_637_600_000;

    fn render(unit: Unit<'_>, style: Style, values: &[Option<f64>]) -> String {
        chart(&Chart {
            id: "c",
            title: "Bytes per hour: <team>",
            unit,
            style,
            from_ms: TEN,
            step_ms: HOUR,
            values,
        })
        .into_string()
    }

    #[test]
    fn round_ceilings_are_one_two_or_five_times_a_power_of_ten() {
        let cases = [
            (0.0, 1.0),
            (-3.0, 1.0),
            (f64::NAN, 1.0),
            (1.0, 1.0),
            (1.2, 2.0),
            (3.0, 5.0),
            (7.0, 10.0),
            (10.0, 10.0),
            (0.042, 0.05),
            (1_234_567.0, 2_000_000.0),
        ];
        for (max, expected) in cases {
            let got = nice_ceiling(max);
            assert!((got - expected).abs() < expected * 1e-9, "{max}: {got}");
        }
    }

    #[test]
    fn values_are_shown_in_their_unit() {
        let cases = [
            (Unit::Bytes, 0.0, "0 B"),
            (Unit::Bytes, 950.0, "950 B"),
            (Unit::Bytes, 1500.0, "1.50 kB"),
            (Unit::Bytes, 25_300_000.0, "25.3 MB"),
            (Unit::Bytes, 2e9, "2.00 GB"),
            (Unit::Money("EUR"), 12.345, "12.35 EUR"),
            (Unit::Money("USD"), 0.0042, "0.0042 USD"),
            (Unit::Money("USD"), 0.0, "0 USD"),
            (Unit::Rate, 0.875, "88 %"),
        ];
        for (unit, value, expected) in cases {
            assert_eq!(format_value(unit, value), expected, "{unit:?} {value}");
        }
    }

    #[test]
    fn a_chart_is_an_image_with_a_title_a_description_axes_and_a_table() {
        let svg = render(
            Unit::Bytes,
            Style::Bars,
            &[Some(1000.0), None, Some(4000.0), Some(0.0)],
        );
        assert!(
            svg.contains(r#"role="img" aria-labelledby="c-title c-desc""#),
            "{svg}"
        );
        // Escaped, as every value on the page.
        assert!(
            svg.contains(r#"<title id="c-title">Bytes per hour: &lt;team&gt;</title>"#),
            "{svg}"
        );
        assert!(svg.contains("From 10:00 to 14:00 UTC, 3 of 4 steps with data: total 5.00 kB, highest 4.00 kB at 12:00."), "{svg}");
        // Axes: 0, half and the round top (5 kB), and the times at start, middle and end.
        for label in ["0 B", "2.50 kB", "5.00 kB", ">10:00<", ">11:00<", ">14:00<"] {
            assert!(svg.contains(label), "{label}: {svg}");
        }
        assert_eq!(
            svg.matches("<rect").count(),
            2,
            "a bar per value above zero, none for a gap"
        );
        // The tallest bar reaches 4/5 of the plot: y = base - 0.8 * height.
        let (base, height) = (HEIGHT - BOTTOM, HEIGHT - BOTTOM - MARGIN);
        assert!(
            svg.contains(&format!(r#"y="{}""#, base - 0.8 * height)),
            "{svg}"
        );
        assert_eq!(
            svg.matches("<tr>").count(),
            5,
            "a header and a row per step"
        );
        assert!(svg.contains("<td>11:00</td><td>—</td>"), "{svg}");
        assert!(!svg.contains("style="), "the CSP allows no style attribute");
    }

    #[test]
    fn an_empty_chart_says_so() {
        for values in [&[][..], &[None, None][..]] {
            let svg = render(Unit::Money("USD"), Style::Bars, values);
            assert!(svg.contains(">No data</text>"), "{svg}");
            assert!(svg.contains("No data from 10:00"), "{svg}");
            assert!(!svg.contains("<rect"), "{svg}");
            // Still an axis from nothing to 1.
            assert!(svg.contains(">1.00 USD<"), "{svg}");
        }
    }

    #[test]
    fn one_point_is_a_dot_and_a_run_is_a_line_broken_at_gaps() {
        let svg = render(Unit::Rate, Style::Line, &[Some(0.5)]);
        assert_eq!(svg.matches("<circle").count(), 1, "{svg}");
        assert!(!svg.contains("<polyline"), "{svg}");
        assert!(svg.contains(">100 %<"), "rates always up to 100 %: {svg}");
        let svg = render(
            Unit::Rate,
            Style::Line,
            &[
                Some(1.0),
                Some(0.5),
                None,
                Some(0.25),
                Some(0.0),
                None,
                Some(1.0),
            ],
        );
        assert_eq!(svg.matches("<polyline").count(), 2, "{svg}");
        assert_eq!(svg.matches("<circle").count(), 1, "{svg}");
        assert!(svg.contains("average 55 %"), "{svg}");
    }

    #[test]
    fn runs_split_at_gaps() {
        let runs = runs(&[None, Some(1.0), Some(2.0), None, Some(3.0)]);
        assert_eq!(runs, vec![vec![(1, 1.0), (2, 2.0)], vec![(4, 3.0)]]);
    }
}
