//! The figures' look: run colours, fonts and sizes, line strokes, and the
//! number formats of the axes.

use plotters::coord::Shift;
use plotters::prelude::*;

/// The SVG surface every figure part draws on.
pub(super) type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// Tableau 10: distinct, colour-blind-friendly, readable on white.
const PALETTE: [RGBColor; 10] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xed, 0xc9, 0x48),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0xff, 0x9d, 0xa7),
    RGBColor(0x9c, 0x75, 0x5f),
    RGBColor(0xba, 0xb0, 0xac),
];

/// The colour of the i-th run (cycles past ten runs).
pub fn run_color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

pub(super) const FONT: &str = "sans-serif";
pub(super) const KEY_GREY: RGBColor = RGBColor(0x55, 0x55, 0x55);
pub(super) const LEGEND_W: u32 = 250;
pub(super) const PLOT_W: u32 = 880;
pub(super) const PANEL_H: u32 = 360;
pub(super) const TITLE_H: u32 = 44;

#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Stroke {
    Solid,
    Dashed,
    /// Thin and pale: raw per-step values under a smoothed curve.
    Faint,
}

pub(super) fn fmt_auto(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 1e3 {
        let k = v / 1e3;
        if (k - k.round()).abs() < 1e-9 {
            format!("{k:.0}k")
        } else {
            format!("{k:.1}k")
        }
    } else if v.fract() == 0.0 || a >= 10.0 {
        format!("{v:.0}")
    } else {
        // 0.8, 2.5, 0.25: no trailing zeros.
        let t = if a < 0.1 {
            format!("{v:.3}")
        } else {
            format!("{v:.2}")
        };
        t.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

pub(super) fn fmt_step(v: &f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{:.0}", v.round())
    } else {
        format!("{v:.1}")
    }
}

pub(super) fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

pub(super) fn stroke_style(color: RGBColor, stroke: Stroke) -> ShapeStyle {
    match stroke {
        Stroke::Solid | Stroke::Dashed => ShapeStyle {
            color: color.to_rgba(),
            filled: false,
            stroke_width: 2,
        },
        Stroke::Faint => ShapeStyle {
            color: color.mix(0.3),
            filled: false,
            stroke_width: 1,
        },
    }
}
