//! The legend strip right of the panels: the runs with their colours, the
//! keys of the figure's line styles, and the script-version marks.

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::panel::Key;
use super::style::{run_color, stroke_style, truncate, Area, Stroke, FONT, KEY_GREY};
use super::PlotError;
use crate::report::Run;

/// Left end and right end of a key's sample, and where its text starts.
const X0: i32 = 12;
const X1: i32 = 44;
const XT: i32 = 52;

fn text<'a>(
    t: &str,
    at: (i32, i32),
    color: &'a RGBColor,
    size: u32,
) -> Text<'a, (i32, i32), String> {
    Text::new(
        t.to_string(),
        at,
        TextStyle::from((FONT, size).into_font())
            .color(color)
            .pos(Pos::new(HPos::Left, VPos::Center)),
    )
}

pub(super) fn draw_legend(
    area: &Area,
    runs: &[Run],
    keys: &[Key],
    marks: bool,
) -> Result<(), PlotError> {
    let mut y = 40;
    area.draw(&text("runs", (X0, y), &BLACK, 14))?;
    y += 24;
    for (i, r) in runs.iter().enumerate() {
        let c = run_color(i);
        area.draw(&PathElement::new(vec![(X0, y), (X1, y)], c.stroke_width(4)))?;
        area.draw(&text(&truncate(&r.name, 26), (XT, y), &BLACK, 13))?;
        y += 22;
    }
    if !keys.is_empty() || marks {
        y += 12;
        area.draw(&text("key", (X0, y), &BLACK, 14))?;
        y += 24;
    }
    for k in keys {
        let label = draw_key_sample(area, *k, y)?;
        area.draw(&text(label, (XT, y), &BLACK, 12))?;
        y += 22;
    }
    if marks {
        draw_marks_key(area, y)?;
    }
    Ok(())
}

/// The sample of one key at height `y`; its label.
fn draw_key_sample(area: &Area, k: Key, y: i32) -> Result<&'static str, PlotError> {
    Ok(match k {
        Key::Line(stroke, label) => {
            let mut st = stroke_style(KEY_GREY, stroke);
            if stroke == Stroke::Faint {
                // Pale grey on white barely shows at legend size.
                st.color = KEY_GREY.mix(0.5);
            }
            if stroke == Stroke::Dashed {
                area.draw(&PathElement::new(vec![(X0, y), (X0 + 10, y)], st))?;
                area.draw(&PathElement::new(vec![(X0 + 16, y), (X0 + 26, y)], st))?;
                area.draw(&PathElement::new(vec![(X0 + 32, y), (X1, y)], st))?;
            } else {
                area.draw(&PathElement::new(vec![(X0, y), (X1, y)], st))?;
            }
            label
        }
        Key::Markers(label) => {
            area.draw(&PathElement::new(
                vec![(X0, y), (X1, y)],
                stroke_style(KEY_GREY, Stroke::Solid),
            ))?;
            area.draw(&Circle::new(((X0 + X1) / 2, y), 4, KEY_GREY.filled()))?;
            label
        }
        Key::Band(label) => {
            area.draw(&Rectangle::new(
                [(X0, y - 7), (X1, y + 7)],
                KEY_GREY.mix(0.2).filled(),
            ))?;
            area.draw(&PathElement::new(
                vec![(X0, y), (X1, y)],
                stroke_style(KEY_GREY, Stroke::Solid),
            ))?;
            label
        }
    })
}

/// The three kinds of script-version mark, from height `y` down.
fn draw_marks_key(area: &Area, mut y: i32) -> Result<(), PlotError> {
    let grey = KEY_GREY.stroke_width(1);
    let mid = (X0 + X1) / 2;
    area.draw(&PathElement::new(vec![(mid, y - 8), (mid, y + 8)], grey))?;
    area.draw(&text("reload (new hash)", (XT, y), &BLACK, 12))?;
    y += 22;
    for dy in [-8, -2, 4] {
        area.draw(&PathElement::new(
            vec![(mid, y + dy), (mid, y + dy + 2)],
            grey,
        ))?;
    }
    area.draw(&text("hash change, no reload log", (XT, y), &BLACK, 12))?;
    y += 22;
    area.draw(&Cross::new((mid, y), 5, KEY_GREY.stroke_width(2)))?;
    area.draw(&text("rejected / reverted reload", (XT, y), &BLACK, 12))?;
    Ok(())
}
