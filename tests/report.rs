//! `actguide report` end to end: two synthetic run directories in the real
//! file formats (one new-style with per-rollout depths, panels, regions and
//! reloads; one old-style without them) → figures, report.md and a
//! self-contained, deterministic report.html, rendered in headless
//! Chromium when it is installed (and required to be on CI).

use std::path::{Path, PathBuf};
use std::process::Command;

use actguide::report::{write_report, ReportSummary};
use serde_json::{json, Value};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn write_jsonl(path: &Path, lines: &[Value]) {
    let text: String = lines.iter().map(|v| format!("{v}\n")).collect();
    std::fs::write(path, text).unwrap();
}

const STEPS_A: u64 = 12;
const STEPS_B: u64 = 8;

/// Probe rollouts of run A at step s (varies, so sums are checkable).
fn probes_a(s: u64) -> u64 {
    (s % 3) * 4
}

/// A new-style run: depths_by_cluster, test and train panels with
/// regions, and reloads (ok at 3, rejected at 6, reverted at 8), plus an
/// unexplained hash change at step 10.
fn run_a(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("experiment.json"),
        json!({"name": "alpha", "seed": 7, "steps": STEPS_A,
               "guidance": {"script": "scripts/guidance/actguide.rhai", "clusters": 2}})
        .to_string(),
    )
    .unwrap();
    let metrics: Vec<Value> = (0..STEPS_A)
        .map(|s| {
            let hash = match s {
                0..=3 => "aaaa1111bbbb",
                4..=9 => "cccc2222dddd",
                _ => "eeee3333ffff",
            };
            let d0: Vec<u64> = (0..8).map(|i| (i + s) % 4).collect();
            let d1: Vec<u64> = (0..8).map(|i| 2 + (i * s) % 5).collect();
            let probes = probes_a(s);
            json!({
                "step": s,
                "success": 0.2 + 0.05 * s as f64,
                "success_round0": 0.1 + 0.04 * s as f64,
                "rollouts": 64 + probes,
                "rounds": {"probe_rollouts": probes, "trained_rollouts": 64, "rounds_mean": 1.5},
                "guided_frac": 0.5, "depth_mean": 2.0, "plan_k_mean": 0.0,
                "depth_ratio_by_cluster": {"0": 0.5 - 0.02 * s as f64, "1": 0.7},
                "depths_by_cluster": {"0": d0, "1": d1},
                "success_by_cluster": {"0": 0.6, "1": 0.3},
                "time": {"step_s": 2.0, "rollout_s": 0.8, "train_s": 1.1,
                         "rollout_tokens_per_s": 30000.0 + 100.0 * s as f64,
                         "train_tokens_per_s": 12000.0},
                "script_hash": hash,
                "script_hashes": {"guidance": hash},
                "pg_loss": 0.1, "kl": 0.0, "entropy": 4.9, "lr": 0.001
            })
        })
        .collect();
    write_jsonl(&dir.join("metrics.jsonl"), &metrics);
    let mut evals = Vec::new();
    for s in [0u64, 4, 8, 12] {
        for (panel, base) in [("test", 0.1), ("train", 0.2)] {
            evals.push(json!({
                "step": s, "panel": panel, "greedy": true, "episodes": 16,
                "success": base + 0.05 * s as f64,
                "success_by_cluster": {"0": 0.5, "1": 0.1},
                "success_by_type": {"pick": 0.4},
                "success_in_region": base + 0.3 + 0.02 * s as f64,
                "success_out_region": if s == 0 { Value::Null } else { json!(0.01 * s as f64) },
                "in_region_tasks": 5, "out_region_tasks": 11,
                "time": {"eval_s": 0.5}
            }));
        }
    }
    write_jsonl(&dir.join("eval.jsonl"), &evals);
    write_jsonl(
        &dir.join("reloads.jsonl"),
        &[
            json!({"step": 3, "role": "guidance", "file": "scripts/guidance/actguide.rhai",
                   "ok": true, "hash": "cccc2222dddd", "copy": "scripts/guidance-cccc2222dddd"}),
            json!({"step": 6, "role": "guidance", "file": "scripts/guidance/actguide.rhai",
                   "ok": false, "error": "file:3:1: syntax error", "active": "cccc2222dddd"}),
            json!({"step": 8, "role": "guidance", "file": "scripts/guidance/actguide.rhai",
                   "ok": false, "reverted": true, "error": "runtime error", "active": "cccc2222dddd"}),
        ],
    );
}

/// An old-style run: no depths lists, no panel/region keys, no reloads.
fn run_b(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("experiment.json"),
        json!({"name": "beta", "guidance": {"script": "scripts/guidance.rhai"}}).to_string(),
    )
    .unwrap();
    let metrics: Vec<Value> = (0..STEPS_B)
        .map(|s| {
            json!({
                "step": s, "success": 0.5, "rollouts": 32,
                "rounds": {"probe_rollouts": 0, "trained_rollouts": 32},
                "depth_ratio_by_cluster": {"0": 0.3, "1": 0.6, "2": 0.9},
                "time": {"step_s": 1.5, "rollout_tokens_per_s": 20000.0, "train_tokens_per_s": 9000.0},
                "script_hash": "1234567890ab", "script_hashes": {"guidance": "1234567890ab"}
            })
        })
        .collect();
    write_jsonl(&dir.join("metrics.jsonl"), &metrics);
    write_jsonl(
        &dir.join("eval.jsonl"),
        &[
            json!({"step": 0, "success": 0.25, "greedy": false, "episodes": 8, "time": {"eval_s": 1.0}}),
            json!({"step": 8, "success": 0.375, "greedy": false, "episodes": 8, "time": {"eval_s": 1.0}}),
        ],
    );
}

fn make_runs(tmp: &Path) -> Vec<PathBuf> {
    let a = tmp.join("alpha");
    let b = tmp.join("beta");
    run_a(&a);
    run_b(&b);
    vec![a, b]
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Cells of the markdown table row of `run`.
fn md_row(md: &str, run: &str) -> Vec<String> {
    let line = md
        .lines()
        .find(|l| l.starts_with(&format!("| {run} |")))
        .unwrap_or_else(|| panic!("no row for {run} in\n{md}"));
    line.trim_matches('|')
        .split(" | ")
        .map(|c| c.trim().to_string())
        .collect()
}

#[test]
fn report_from_two_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = make_runs(tmp.path());
    let out = tmp.path().join("report");
    let summary: ReportSummary = write_report(&runs, &out).unwrap();
    assert!(summary.warnings.is_empty(), "{:?}", summary.warnings);

    let svgs = [
        "success_train.svg",
        "success_test.svg",
        "success_regions.svg",
        "depth.svg",
        "rollouts.svg",
        "time.svg",
        "throughput.svg",
    ];
    for f in svgs {
        let svg = read(&out.join(f));
        assert!(
            svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
            "{f}"
        );
    }
    assert_eq!(summary.files.len(), svgs.len() + 2);

    // The reload markers and their labels reach the success plots.
    let train_svg = read(&out.join("success_train.svg"));
    for label in ["cccc2222", "rejected", "reverted", "eeee3333"] {
        assert!(train_svg.contains(label), "no {label} marker label");
    }
    // Both runs are in the legend.
    assert!(train_svg.contains("\nalpha\n</text>"));
    assert!(train_svg.contains("\nbeta\n</text>"));

    // The table: rollouts are summed over steps, probes included.
    let md = read(&out.join("report.md"));
    let total_a: u64 = (0..STEPS_A).map(|s| 64 + probes_a(s)).sum();
    let probes: u64 = (0..STEPS_A).map(probes_a).sum();
    let a = md_row(&md, "alpha");
    assert_eq!(a.len(), 17, "{a:?}");
    assert_eq!(a[1], "scripts/guidance/actguide.rhai");
    assert_eq!(a[2], STEPS_A.to_string());
    assert_eq!(a[3], "0.700 @12"); // final test: 0.1 + 0.05 * 12
    assert_eq!(a[4], "0.700 @12");
    assert_eq!(a[5], "0.640"); // in-region at step 12
    assert_eq!(a[6], "0.120"); // out-region at step 12
    assert_eq!(a[7], "0.800 @12"); // train panel
    assert_eq!(a[8], "0.120"); // train out-region at step 12
    assert_eq!(a[9], total_a.to_string());
    assert_eq!(a[10], probes.to_string());
    assert_eq!(a[11], format!("{:.1}", total_a as f64 / STEPS_A as f64));
    // Wall time: 12 steps × 2 s + 8 evaluations × 0.5 s.
    assert_eq!(a[12], "28.0");
    assert_eq!(a[13], "30550"); // mean of 30000 + 100 s, s = 0..11
    assert_eq!(a[15], "3"); // three script versions
    assert_eq!(a[16], "1 / 2");
    let b = md_row(&md, "beta");
    assert_eq!(b[3], "0.375 @8");
    assert_eq!(b[4], "0.375 @8");
    assert_eq!(
        (b[5].as_str(), b[6].as_str(), b[7].as_str(), b[8].as_str()),
        ("–", "–", "–", "–")
    );
    assert_eq!(b[9], "256");
    assert_eq!(b[12], "14.0");
    assert_eq!(b[16], "0 / 0");
    for f in svgs {
        assert!(
            md.contains(&format!("]({f})")),
            "report.md lacks a link to {f}"
        );
    }
    assert!(summary.table.contains("| alpha |"));

    // The page is self-contained: every figure inlined, nothing fetched.
    let html = read(&out.join("report.html"));
    assert_eq!(html.matches("<svg").count(), svgs.len());
    assert!(html.contains("<table class=\"summary\">"));
    for bad in [
        "src=\"http",
        "<link",
        "<img",
        "<script",
        "href=\"http",
        "@import",
    ] {
        assert!(!html.contains(bad), "report.html contains {bad}");
    }

    // Deterministic: a second report of the same runs is byte-identical.
    let out2 = tmp.path().join("report2");
    write_report(&runs, &out2).unwrap();
    for f in summary.files.iter() {
        let name = f.file_name().unwrap();
        assert_eq!(
            std::fs::read(f).unwrap(),
            std::fs::read(out2.join(name)).unwrap(),
            "{} differs between two identical reports",
            name.to_string_lossy()
        );
    }

    browser_check(&out.join("report.html"), tmp.path());

    // To look at the synthetic report: ACTGUIDE_REPORT_TEST_OUT=some/dir.
    if let Some(keep) = std::env::var_os("ACTGUIDE_REPORT_TEST_OUT") {
        write_report(&runs, Path::new(&keep)).unwrap();
    }
}

/// Render in headless Chromium with scripts/check-report.sh. Without
/// Chromium the check is skipped locally but fails on CI (CI=true), so CI
/// really checks rendering. Also makes sure the checker is not vacuous: a
/// page with a script error and an outside image must fail it.
fn browser_check(html: &Path, tmp: &Path) {
    let have_chromium = ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .any(|c| {
            Command::new("sh")
                .args(["-c", &format!("command -v {c}")])
                .output()
                .is_ok_and(|o| o.status.success())
        });
    if !have_chromium {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "CI=true but no chromium on PATH: .ci/run must install it"
        );
        eprintln!("chromium not on PATH: skipping the headless-browser check");
        return;
    }
    let script = root().join("scripts/check-report.sh");
    let png = tmp.join("report.png");
    let o = Command::new("bash")
        .arg(&script)
        .arg(html)
        .arg(&png)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "check-report.sh failed:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        std::fs::metadata(&png).unwrap().len() > 10_000,
        "tiny screenshot"
    );

    let bad = tmp.join("bad.html");
    std::fs::write(
        &bad,
        "<!DOCTYPE html><html><head><meta name=\"actguide-figures\" content=\"1\"></head>\
         <body><svg></svg><table class=\"summary\"><tr><th>run</th></tr><tr><td>x</td></tr>\
         </table><script>notDefined();</script><img src=\"missing.png\"></body></html>",
    )
    .unwrap();
    let o = Command::new("bash")
        .arg(&script)
        .arg(&bad)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "bad page passed the check: {err}");
    assert!(
        err.contains("notDefined"),
        "script error not reported: {err}"
    );
    assert!(
        err.contains("missing.png"),
        "outside resource not reported: {err}"
    );
}

#[test]
fn errors_name_the_run_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = make_runs(tmp.path());
    let empty = tmp.path().join("not_a_run");
    std::fs::create_dir_all(&empty).unwrap();
    let e = write_report(&[runs[0].clone(), empty], &tmp.path().join("o"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("not_a_run") && e.contains("metrics.jsonl"),
        "{e}"
    );

    let mut text = read(&runs[1].join("eval.jsonl"));
    text.push_str("{\"step\": 9, \"success\": }\n");
    std::fs::write(runs[1].join("eval.jsonl"), text).unwrap();
    let e = write_report(&runs, &tmp.path().join("o"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("eval.jsonl:3: bad JSON"), "{e}");

    assert!(write_report(&[], &tmp.path().join("o")).is_err());
}
