//! The figure of `actguide probe` (ActGuide-RL Fig. 3): per task, bars of
//! the guidance influence ‖ΔLogit‖ at each state along the guided
//! trajectory and a line of the unguided continuations' success rate,
//! with Pass@K marked and the reachability barrier shaded.

use plotters::prelude::*;

use super::plot::PlotError;
use crate::rundir::probe::ProbeResult;

const BLUE: RGBColor = RGBColor(0x4e, 0x79, 0xa7);
const RED: RGBColor = RGBColor(0xe1, 0x57, 0x59);
const SHADE: RGBColor = RGBColor(0xf2, 0xd4, 0x9b);
const PANEL_H: u32 = 230;
const WIDTH: u32 = 900;

/// The probe figure as an SVG document (one panel per task).
pub fn probe_svg(r: &ProbeResult) -> Result<String, PlotError> {
    let n = r.tasks.len().max(1);
    let height = 50 + PANEL_H * n as u32;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let (title, body) = root.split_vertically(50);
        title
            .draw(&Text::new(
                format!(
                    "Reachability along guided rollouts ({} policy, step {}): bars ‖ΔLogit‖, line = unguided success from s_t (K = {}), shaded = barrier",
                    r.policy, r.step, r.k
                ),
                (10, 18),
                ("sans-serif", 15).into_font(),
            ))
            ?;
        let panels = body.split_evenly((n, 1));
        let dmax = r
            .tasks
            .iter()
            .flat_map(|t| t.points.iter().map(|p| p.delta_logit))
            .fold(1e-6f64, f64::max)
            * 1.15;
        for (t, area) in r.tasks.iter().zip(panels.iter()) {
            let len = t.points.len().max(1);
            let mut chart = ChartBuilder::on(area)
                .caption(
                    format!(
                        "{} ({}, {} expert actions): barrier at t = {}",
                        t.id, t.task_type, t.expert_len, t.barrier
                    ),
                    ("sans-serif", 14),
                )
                .margin(8)
                .x_label_area_size(30)
                .y_label_area_size(55)
                .right_y_label_area_size(55)
                .build_cartesian_2d(-0.5f64..(len as f64 - 0.5), 0.0f64..dmax)?
                .set_secondary_coord(-0.5f64..(len as f64 - 0.5), 0.0f64..1.05f64);
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_labels(len.min(12))
                .x_label_formatter(&|x| format!("{}", x.round() as i64))
                .x_desc("state s_t (t expert actions executed)")
                .y_desc("‖ΔLogit‖")
                .draw()?;
            chart
                .configure_secondary_axes()
                .y_desc("unguided success from s_t")
                .draw()?;
            if t.barrier > 0 {
                // The barrier interval [barrier − 1, barrier): the step after
                // which reward becomes reachable.
                let b = t.barrier as f64;
                chart.draw_series(std::iter::once(Rectangle::new(
                    [(b - 1.5, 0.0), (b - 0.5, dmax)],
                    SHADE.mix(0.6).filled(),
                )))?;
            }
            chart.draw_series(t.points.iter().map(|p| {
                let x = p.t as f64;
                Rectangle::new([(x - 0.3, 0.0), (x + 0.3, p.delta_logit)], BLUE.filled())
            }))?;
            let rate: Vec<(f64, f64)> = t
                .points
                .iter()
                .map(|p| (p.t as f64, p.successes as f64 / p.k.max(1) as f64))
                .collect();
            chart.draw_secondary_series(LineSeries::new(rate.clone(), RED.stroke_width(2)))?;
            chart.draw_secondary_series(t.points.iter().zip(&rate).map(|(p, &(x, y))| {
                // Filled: Pass@K = 1; hollow: no continuation succeeded.
                if p.pass {
                    Circle::new((x, y), 4, RED.filled())
                } else {
                    Circle::new((x, y), 4, RED.stroke_width(2))
                }
            }))?;
        }
        root.present()?;
    }
    Ok(svg)
}
