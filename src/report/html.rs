//! `report.html`: one self-contained page — inline CSS, the summary table
//! as HTML and every figure's SVG inlined — that opens from disk, mail or a
//! CI artifact with nothing else beside it.
//!
//! The page loads nothing and runs no script. A Content-Security-Policy
//! meta tag makes the browser refuse (and log) any external resource, so
//! `scripts/check-report.sh` catches a regression that would link one.
//! A `actguide-figures` meta tag states how many figures the page holds, so
//! the check knows how many `<svg>` elements to expect.

use std::fmt::Write as _;

use super::groups::{group_cells, GroupRow, GROUP_HEADERS, GROUP_NOTE};
use super::plot::Figure;
use super::{table_cells, SummaryRow, TABLE_HEADERS, TABLE_NOTE};

/// Escape text for HTML content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `code` spans in the (markdown) notes become `<code>`.
fn inline_code(s: &str) -> String {
    escape(s)
        .split('`')
        .enumerate()
        .map(|(i, part)| {
            if i % 2 == 1 {
                format!("<code>{part}</code>")
            } else {
                part.to_string()
            }
        })
        .collect()
}

/// The SVG element alone (plotters writes no XML prolog today; strip one if
/// a later version does, since it is invalid inside HTML).
fn svg_element(svg: &str) -> &str {
    svg.find("<svg").map_or(svg, |i| &svg[i..]).trim_end()
}

const CSS: &str = "\
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:24px auto;\
max-width:1400px;padding:0 16px;color:#222;background:#fff}\
h1{font-size:1.5em;margin-bottom:.3em}h2{font-size:1.2em;margin-top:1.6em}\
.note{color:#555;font-size:.9em;max-width:70em}\
.tablewrap{overflow-x:auto}\
table.summary{border-collapse:collapse;font-size:.85em;margin:12px 0}\
table.summary th,table.summary td{border:1px solid #ccc;padding:4px 6px;white-space:nowrap}\
table.summary th{background:#f3f3f3;text-align:center;white-space:normal;min-width:4em;\
vertical-align:bottom}\
table.summary td{text-align:right;font-variant-numeric:tabular-nums}\
table.summary td:nth-child(-n+2){text-align:left}\
table.summary td:nth-child(2){white-space:normal;min-width:8em}\
table.summary tr:nth-child(even) td{background:#fafafa}\
figure{margin:28px 0;border-top:1px solid #e5e5e5;padding-top:12px}\
figure svg{display:block;width:100%;max-width:1260px;height:auto}\
figcaption{color:#444;font-size:.9em;max-width:70em;margin-top:6px}\
code{font-size:.95em;background:#f3f3f3;padding:0 3px;border-radius:3px}\
nav a{margin-right:14px}";

/// The whole page.
pub fn render(
    title: &str,
    rows: &[SummaryRow],
    groups: Option<&[GroupRow]>,
    figures: &[Figure],
) -> String {
    let mut h = String::new();
    h.push_str("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n");
    // Nothing may be fetched; inline styles (the <style> element and the
    // SVGs' attributes) are all the page needs.
    h.push_str(
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; \
         style-src 'unsafe-inline'\">\n",
    );
    h.push_str("<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n");
    let _ = writeln!(
        h,
        "<meta name=\"actguide-figures\" content=\"{}\">",
        figures.len()
    );
    let _ = writeln!(h, "<title>{}</title>", escape(title));
    let _ = writeln!(h, "<style>{CSS}</style>\n</head>\n<body>");
    let _ = writeln!(h, "<h1>{}</h1>", escape(title));

    if let Some(groups) = groups {
        h.push_str("<h2 id=\"seeds\">Over seeds</h2>\n");
        let _ = writeln!(h, "<p class=\"note\">{}</p>", inline_code(GROUP_NOTE));
        table(
            &mut h,
            &GROUP_HEADERS,
            groups
                .iter()
                .map(|g| group_cells(g).iter().map(|c| escape(c)).collect()),
        );
    }
    h.push_str("<h2 id=\"summary\">Summary</h2>\n");
    let _ = writeln!(h, "<p class=\"note\">{}</p>", inline_code(TABLE_NOTE));
    // Long script paths (column 1) may wrap, but only after a slash.
    table(
        &mut h,
        &TABLE_HEADERS,
        rows.iter().map(|r| {
            let mut cells: Vec<String> = table_cells(r).iter().map(|c| escape(c)).collect();
            cells[1] = cells[1].replace('/', "/<wbr>");
            cells
        }),
    );

    h.push_str("<h2 id=\"figures\">Figures</h2>\n<nav>");
    for f in figures {
        let _ = write!(
            h,
            "<a href=\"#{}\">{}</a>",
            escape(&fig_id(&f.file)),
            escape(&f.title)
        );
    }
    h.push_str("</nav>\n");
    for f in figures {
        let _ = writeln!(h, "<figure id=\"{}\">", escape(&fig_id(&f.file)));
        h.push_str(svg_element(&f.svg));
        let _ = writeln!(
            h,
            "\n<figcaption><strong>{}.</strong> {}</figcaption>\n</figure>",
            escape(&f.title),
            inline_code(&f.caption)
        );
    }
    h.push_str("</body>\n</html>\n");
    h
}

/// A summary-styled table of cells that are already HTML (escaped text).
fn table(h: &mut String, headers: &[&str], rows: impl Iterator<Item = Vec<String>>) {
    h.push_str("<div class=\"tablewrap\">\n<table class=\"summary\">\n<thead><tr>");
    for head in headers {
        let _ = write!(h, "<th>{}</th>", escape(head));
    }
    h.push_str("</tr></thead>\n<tbody>\n");
    for cells in rows {
        h.push_str("<tr>");
        for cell in cells {
            let _ = write!(h, "<td>{cell}</td>");
        }
        h.push_str("</tr>\n");
    }
    h.push_str("</tbody>\n</table>\n</div>\n");
}

/// `success_train.svg` → `fig-success_train`.
fn fig_id(file: &str) -> String {
    format!("fig-{}", file.trim_end_matches(".svg"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_and_inlines() {
        let fig = Figure {
            file: "a.svg".into(),
            title: "A <b>".into(),
            caption: "uses `x<y`".into(),
            svg: "<?xml version=\"1.0\"?>\n<svg width=\"1\"></svg>\n".into(),
        };
        let rows = [SummaryRow {
            name: "r&d".into(),
            ..Default::default()
        }];
        let page = render("T", &rows, None, &[fig]);
        assert!(page.contains("<td>r&amp;d</td>"));
        assert!(page.contains("<code>x&lt;y</code>"));
        assert!(page.contains("<figure id=\"fig-a\">\n<svg width=\"1\"></svg>\n<figcaption>"));
        assert!(!page.contains("<?xml"));
        assert!(page.contains("<meta name=\"actguide-figures\" content=\"1\">"));
    }
}
