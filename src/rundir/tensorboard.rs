//! TensorBoard event files of scalars, so a training run can be watched
//! live with `tensorboard --logdir runs/`.
//!
//! This module owns the on-disk format: TFRecord framing (length, masked
//! CRC-32C of the length, data, masked CRC-32C of the data) around
//! protobuf-encoded `tensorflow.Event` messages. Only the fields scalars
//! need are declared (wall_time, step, file_version, summary of
//! tag/simple_value), hand-written with `prost` derives so no `protoc` or
//! build script is involved; unknown fields are never written, so the
//! subset is wire-compatible with TensorBoard's full schema.
//!
//! [`read_events`] reads such a file back (checking both checksums); the
//! tests use it, and it lets tools inspect a run without Python.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

/// `tensorflow.Event` (event.proto), the fields a scalar writer uses.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(oneof = "event::What", tags = "3, 5")]
    pub what: Option<event::What>,
}

pub mod event {
    /// The `what` oneof of `tensorflow.Event`.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum What {
        /// First event of a file: "brain.Event:2".
        #[prost(string, tag = "3")]
        FileVersion(String),
        #[prost(message, tag = "5")]
        Summary(super::Summary),
    }
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value`, scalar case.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    #[prost(string, tag = "1")]
    pub tag: String,
    /// In TensorFlow this is a member of the `value` oneof. Declared
    /// `optional` so that 0.0 is still written: a proto3 plain field
    /// equal to its default is omitted, and TensorBoard would then see a
    /// value with no data and drop every zero loss or success rate.
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
}

/// Event-file errors, naming the file.
#[derive(Debug, thiserror::Error)]
pub enum TensorBoardError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: record at byte {offset}: {msg}", path.display())]
    Corrupt {
        path: PathBuf,
        offset: u64,
        msg: String,
    },
}

/// TFRecord's checksum: CRC-32C, rotated and offset so that checksums of
/// data that itself contains checksums stay well distributed.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Seconds since the Unix epoch, as events' `wall_time` wants it.
pub fn wall_time_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The host name for the file name (TensorBoard's convention), or
/// "actguide" where it cannot be read. Reduced to characters that are safe
/// in a file name.
fn host_name() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    let clean: String = raw
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .collect();
    if clean.is_empty() {
        "actguide".into()
    } else {
        clean
    }
}

/// Appends scalar events to one event file.
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// Create `dir` if needed and a new file
    /// `dir/events.out.tfevents.<unix_secs>.<hostname>` in it (with a
    /// `.N` suffix if a writer already made one this second, e.g. a resume
    /// right after a stop), and write the file-version event.
    pub fn create(dir: &Path) -> Result<Self, TensorBoardError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| TensorBoardError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let now = wall_time_now();
        let base = format!("events.out.tfevents.{}.{}", now as u64, host_name());
        let mut n = 0;
        let (path, file) = loop {
            let name = if n == 0 {
                base.clone()
            } else {
                format!("{base}.{n}")
            };
            let path = dir.join(name);
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(f) => break (path, f),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                Err(e) => return Err(io(&path)(e)),
            }
        };
        let mut w = EventWriter {
            path,
            out: BufWriter::new(file),
        };
        w.write_event(&Event {
            wall_time: now,
            step: 0,
            what: Some(event::What::FileVersion("brain.Event:2".into())),
        })?;
        w.flush()?;
        Ok(w)
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append one event holding `scalars` (tag, value) at `step`, and
    /// flush, so a TensorBoard watching the run sees each step as it ends
    /// (one small write per training step costs nothing next to the step).
    pub fn write_scalars(
        &mut self,
        step: i64,
        wall_time: f64,
        scalars: &[(String, f64)],
    ) -> Result<(), TensorBoardError> {
        let summary = Summary {
            value: scalars
                .iter()
                .map(|(tag, v)| SummaryValue {
                    tag: tag.clone(),
                    simple_value: Some(*v as f32),
                })
                .collect(),
        };
        self.write_event(&Event {
            wall_time,
            step,
            what: Some(event::What::Summary(summary)),
        })?;
        self.flush()
    }

    /// Append any event (TFRecord-framed).
    pub fn write_event(&mut self, event: &Event) -> Result<(), TensorBoardError> {
        let data = prost::Message::encode_to_vec(event);
        let len = (data.len() as u64).to_le_bytes();
        let mut rec = Vec::with_capacity(data.len() + 16);
        rec.extend_from_slice(&len);
        rec.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
        rec.extend_from_slice(&data);
        rec.extend_from_slice(&masked_crc32c(&data).to_le_bytes());
        self.out
            .write_all(&rec)
            .map_err(|source| TensorBoardError::Io {
                path: self.path.clone(),
                source,
            })
    }

    pub fn flush(&mut self) -> Result<(), TensorBoardError> {
        self.out.flush().map_err(|source| TensorBoardError::Io {
            path: self.path.clone(),
            source,
        })
    }
}

/// Read every event of a file, checking both checksums of each record.
pub fn read_events(path: &Path) -> Result<Vec<Event>, TensorBoardError> {
    let bytes = std::fs::read(path).map_err(|source| TensorBoardError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let corrupt = |offset: usize, msg: &str| TensorBoardError::Corrupt {
        path: path.to_path_buf(),
        offset: offset as u64,
        msg: msg.to_string(),
    };
    let u32_at = |i: usize| -> Option<u32> {
        Some(u32::from_le_bytes(bytes.get(i..i + 4)?.try_into().ok()?))
    };
    let mut events = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let len_bytes = bytes
            .get(at..at + 8)
            .ok_or_else(|| corrupt(at, "truncated length"))?;
        let len_crc = u32_at(at + 8).ok_or_else(|| corrupt(at, "truncated length checksum"))?;
        if masked_crc32c(len_bytes) != len_crc {
            return Err(corrupt(at, "length checksum mismatch"));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap_or_default());
        let start = at + 12;
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| start.checked_add(l))
            .filter(|&e| e + 4 <= bytes.len())
            .ok_or_else(|| corrupt(at, "truncated data"))?;
        let data = &bytes[start..end];
        if u32_at(end) != Some(masked_crc32c(data)) {
            return Err(corrupt(at, "data checksum mismatch"));
        }
        let ev = <Event as prost::Message>::decode(data)
            .map_err(|e| corrupt(at, &format!("bad event: {e}")))?;
        events.push(ev);
        at = end + 4;
    }
    Ok(events)
}

/// Flatten the numeric leaves of a JSON object into scalar tags:
/// `{"success":0.5,"time":{"step_s":1.2}}` with prefix "train" gives
/// `train/success` and `train/time/step_s`. Arrays, strings, booleans and
/// nulls are skipped (per-rollout lists and hashes are not curves).
pub fn scalars_from_json(prefix: &str, v: &Value) -> Vec<(String, f64)> {
    fn walk(tag: &str, v: &Value, out: &mut Vec<(String, f64)>) {
        match v {
            Value::Number(n) => {
                if let Some(x) = n.as_f64().filter(|x| x.is_finite()) {
                    out.push((tag.to_string(), x));
                }
            }
            Value::Object(m) => {
                for (k, x) in m {
                    let t = if tag.is_empty() {
                        k.clone()
                    } else {
                        format!("{tag}/{k}")
                    };
                    walk(&t, x, out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(prefix, v, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn flattens_numeric_leaves() {
        let v = json!({
            "success": 0.5, "step": 3, "script_hash": "ab", "greedy": true,
            "time": {"step_s": 1.25}, "success_by_cluster": {"0": 0.0},
            "depths_by_cluster": {"0": [1, 2]}, "x": null
        });
        let mut got = scalars_from_json("train", &v);
        got.sort_by(|a, b| a.0.cmp(&b.0));
        let want = [
            ("train/step", 3.0),
            ("train/success", 0.5),
            ("train/success_by_cluster/0", 0.0),
            ("train/time/step_s", 1.25),
        ];
        assert_eq!(
            got,
            want.iter()
                .map(|(t, x)| (t.to_string(), *x))
                .collect::<Vec<_>>()
        );
        assert_eq!(
            scalars_from_json("", &json!({"a": 1})),
            vec![("a".into(), 1.0)]
        );
    }

    /// The file `scripts/check-tensorboard.py` feeds to TensorBoard's own
    /// reader: written into $ACTGUIDE_TB_SAMPLE_DIR when set (else a temp
    /// dir), three train steps and one evaluation.
    #[test]
    fn sample_for_tensorboard() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = std::env::var_os("ACTGUIDE_TB_SAMPLE_DIR")
            .map_or_else(|| tmp.path().to_path_buf(), PathBuf::from);
        let mut w = EventWriter::create(&dir).unwrap();
        for step in 0..3i64 {
            let s = step as f64;
            let line = json!({
                "step": step, "success": 0.25 * s, "kl": 0.0,
                "time": {"step_s": 1.5 + s}, "success_by_cluster": {"0": 0.5, "1": 0.125 * s},
                "script_hash": "cf432edbec3f", "depths_by_cluster": {"0": [1, 2]}
            });
            w.write_scalars(
                step,
                1_700_000_000.0 + s,
                &scalars_from_json("train", &line),
            )
            .unwrap();
        }
        let eval = json!({"success": 0.625, "success_in_region": 0.75, "success_out_region": null});
        w.write_scalars(2, 1_700_000_002.5, &scalars_from_json("eval", &eval))
            .unwrap();
        assert_eq!(read_events(w.path()).unwrap().len(), 5);
    }

    #[test]
    fn known_masked_crc() {
        // CRC-32C("123456789") = 0xE3069283 (the standard check value).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        let crc: u32 = 0xe306_9283;
        // TFRecord's formula as written in TensorFlow, not via rotate_right,
        // so the test checks our implementation against the spec.
        #[allow(clippy::manual_rotate)]
        let want = ((crc >> 15) | (crc << 17)).wrapping_add(0xa282_ead8);
        assert_eq!(masked_crc32c(b"123456789"), want);
    }

    #[test]
    fn writes_events_that_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("tb");
        let mut w = EventWriter::create(&sub).unwrap();
        let name = w.path().file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        w.write_scalars(
            0,
            100.5,
            &[("train/success".into(), 0.0), ("train/kl".into(), 0.25)],
        )
        .unwrap();
        w.write_scalars(7, 101.0, &[("eval/success".into(), 0.75)])
            .unwrap();
        // A second writer in the same second gets its own file.
        let w2 = EventWriter::create(&sub).unwrap();
        assert_ne!(w2.path(), w.path());

        let evs = read_events(w.path()).unwrap();
        assert_eq!(evs.len(), 3);
        assert_eq!(
            evs[0].what,
            Some(event::What::FileVersion("brain.Event:2".into()))
        );
        assert!(evs[0].wall_time > 1.6e9);
        assert_eq!((evs[1].step, evs[1].wall_time), (0, 100.5));
        let Some(event::What::Summary(s)) = &evs[1].what else {
            panic!("no summary: {:?}", evs[1]);
        };
        let tv: Vec<(&str, Option<f32>)> = s
            .value
            .iter()
            .map(|v| (v.tag.as_str(), v.simple_value))
            .collect();
        // The zero is written, not dropped as a proto3 default.
        assert_eq!(
            tv,
            vec![("train/success", Some(0.0)), ("train/kl", Some(0.25))]
        );
        assert_eq!(evs[2].step, 7);

        // A flipped byte is caught by the data checksum.
        let mut bytes = std::fs::read(w.path()).unwrap();
        let last = bytes.len() - 6;
        bytes[last] ^= 0xff;
        let bad = dir.path().join("bad");
        std::fs::write(&bad, &bytes).unwrap();
        let e = read_events(&bad).unwrap_err().to_string();
        assert!(e.contains("checksum"), "{e}");
    }
}
