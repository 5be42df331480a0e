//! The readout: [`TelemetryRecord`] (one JSON line per (step, layer)), the deferred
//! [`TelemetrySink`] and the JSON-lines writer and reader.

use crate::config::TelemetryConfig;
use crate::exact::ExactSum;
use crate::summary::AttnSummary;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use tessera_core::{Error, Result};

/// One (step, layer) readout. Per-head arrays have one entry per query head; `null` entries are
/// undefined values (a head with no valid row or no O element) or non-finite ones; a whole
/// field is `null` when its stream was off (and `learned_sink_mass` when there are no learned
/// sinks). See the crate doc for the definitions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TelemetryRecord {
    /// Training step.
    pub step: u64,
    /// Layer index.
    pub layer: u32,
    /// Mean sink mass over valid rows (all batch rows), per head.
    pub sink_mass: Option<Vec<Option<f64>>>,
    /// Fraction of heads (with a defined mean) whose mean sink mass exceeds ε.
    pub sink_rate: Option<f64>,
    /// Mean learned-sink probability over valid rows, per head.
    pub learned_sink_mass: Option<Vec<Option<f64>>>,
    /// Max pre-softcap scaled logit over allowed pairs, per head.
    pub max_logit: Vec<Option<f64>>,
    /// Mean attention entropy (nats) over valid rows, per head.
    pub entropy: Option<Vec<Option<f64>>>,
    /// Valid rows (rows with at least one allowed key), per head.
    pub valid_rows: Option<Vec<u64>>,
    /// Max |O|, per head.
    pub out_abs_max: Option<Vec<Option<f64>>>,
    /// RMS of O, per head.
    pub out_rms: Option<Vec<Option<f64>>>,
    /// Elements of O above `ratio × RMS` of their (b, h) slice, per head.
    pub out_outliers: Option<Vec<u64>>,
    /// How many ranks contributed (their partials reduced before this record was made); absent
    /// in files written before the field existed and by writers that do not know it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<u64>,
    /// Query rows summarised (all batch rows of all contributing ranks); absent as `ranks`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
}

impl TelemetryRecord {
    /// Number of query heads (the length of every per-head array).
    pub fn heads(&self) -> usize {
        self.max_logit.len()
    }

    /// Checks that every per-head array has the same, non-zero length.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let h = self.max_logit.len();
        if h == 0 {
            return Err("max_logit must have one entry per head (found none)".into());
        }
        let lens = [
            ("sink_mass", self.sink_mass.as_ref().map(Vec::len)),
            (
                "learned_sink_mass",
                self.learned_sink_mass.as_ref().map(Vec::len),
            ),
            ("entropy", self.entropy.as_ref().map(Vec::len)),
            ("valid_rows", self.valid_rows.as_ref().map(Vec::len)),
            ("out_abs_max", self.out_abs_max.as_ref().map(Vec::len)),
            ("out_rms", self.out_rms.as_ref().map(Vec::len)),
            ("out_outliers", self.out_outliers.as_ref().map(Vec::len)),
        ];
        for (name, len) in lens {
            if let Some(n) = len {
                if n != h {
                    return Err(format!(
                        "{name} has {n} entries, expected {h} (one per head, as max_logit)"
                    ));
                }
            }
        }
        if let Some(r) = self.sink_rate {
            if !(0.0..=1.0).contains(&r) {
                return Err(format!("sink_rate must be in [0, 1], found {r}"));
            }
        }
        if self.ranks == Some(0) {
            return Err("ranks must be at least 1 when present, found 0".into());
        }
        Ok(())
    }

    /// The record as one JSON line (no trailing newline).
    pub fn to_json_line(&self) -> Result<String> {
        serde_json::to_string(self)
            .map_err(|e| Error::Internal(format!("telemetry record to JSON: {e}")))
    }
}

impl AttnSummary {
    /// The readout (see the crate doc for every field). Fields of a stream that `config`
    /// turns off are `None`.
    pub fn record(&self, config: &TelemetryConfig) -> TelemetryRecord {
        let finite = |x: f64| if x.is_finite() { Some(x) } else { None };
        let mean = |s: &ExactSum, n: u64| {
            if n == 0 {
                None
            } else {
                finite(s.value() / n as f64)
            }
        };
        let hs = &self.heads;
        let sink_mass: Vec<Option<f64>> = hs
            .iter()
            .map(|a| mean(&a.sink_mass_sum, a.valid_rows))
            .collect();
        let defined = sink_mass.iter().flatten().count();
        let above = sink_mass
            .iter()
            .flatten()
            .filter(|&&x| x > config.epsilon)
            .count();
        let sink_rate = if defined == 0 {
            None
        } else {
            Some(above as f64 / defined as f64)
        };
        let sink_on = config.streams.sink;
        let out_on = config.streams.outlier;
        TelemetryRecord {
            step: self.step,
            layer: self.layer,
            max_logit: hs.iter().map(|a| finite(a.max_logit)).collect(),
            sink_rate: if sink_on { sink_rate } else { None },
            learned_sink_mass: (sink_on && self.has_learned_sinks).then(|| {
                hs.iter()
                    .map(|a| mean(&a.learned_sink_mass_sum, a.valid_rows))
                    .collect()
            }),
            entropy: sink_on.then(|| {
                hs.iter()
                    .map(|a| mean(&a.entropy_sum, a.valid_rows))
                    .collect()
            }),
            valid_rows: sink_on.then(|| hs.iter().map(|a| a.valid_rows).collect()),
            sink_mass: sink_on.then_some(sink_mass),
            out_abs_max: out_on.then(|| {
                hs.iter()
                    .map(|a| {
                        if a.out.count == 0 {
                            None
                        } else {
                            finite(a.out.abs_max)
                        }
                    })
                    .collect()
            }),
            out_rms: out_on.then(|| hs.iter().map(|a| finite(a.out.rms())).collect()),
            out_outliers: out_on.then(|| hs.iter().map(|a| a.out.outliers).collect()),
            ranks: None,
            tokens: None,
        }
    }
}

/// Deferred readout: summaries are merged per (step, layer) as they arrive (from layers, batch
/// shards, replicas) and turned into records only at the logging boundary ([`flush`]).
///
/// [`flush`]: TelemetrySink::flush
#[derive(Debug, Clone)]
pub struct TelemetrySink {
    config: TelemetryConfig,
    pending: BTreeMap<(u64, u32), AttnSummary>,
}

impl TelemetrySink {
    /// An empty sink turning summaries into records with `config`.
    pub fn new(config: TelemetryConfig) -> Self {
        TelemetrySink {
            config,
            pending: BTreeMap::new(),
        }
    }

    /// The configuration records are made with.
    pub fn config(&self) -> &TelemetryConfig {
        &self.config
    }

    /// Merges `summary` into the pending summary of its (step, layer).
    pub fn submit(&mut self, summary: AttnSummary) -> Result<()> {
        match self.pending.entry((summary.step, summary.layer)) {
            std::collections::btree_map::Entry::Occupied(mut e) => e.get_mut().merge(&summary),
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert(summary);
                Ok(())
            }
        }
    }

    /// Number of pending (step, layer) summaries.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Turns every pending summary into a record, ordered by (step, layer), and clears them.
    pub fn flush(&mut self) -> Vec<TelemetryRecord> {
        std::mem::take(&mut self.pending)
            .into_values()
            .map(|s| s.record(&self.config))
            .collect()
    }
}

/// Appends records to a JSON-lines file, one record per line.
pub struct JsonlWriter {
    path: PathBuf,
    file: std::io::BufWriter<std::fs::File>,
}

impl JsonlWriter {
    /// Opens `path` for appending (creating it when missing).
    pub fn append(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        Ok(JsonlWriter {
            path,
            file: std::io::BufWriter::new(file),
        })
    }

    /// Writes one record (one line).
    pub fn write(&mut self, record: &TelemetryRecord) -> Result<()> {
        let mut line = record.to_json_line()?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .map_err(|e| Error::io(&self.path, e))
    }

    /// Writes every record, then flushes.
    pub fn write_all(&mut self, records: &[TelemetryRecord]) -> Result<()> {
        for r in records {
            self.write(r)?;
        }
        self.flush()
    }

    /// Flushes buffered lines to the file.
    pub fn flush(&mut self) -> Result<()> {
        self.file.flush().map_err(|e| Error::io(&self.path, e))
    }
}

/// Parses JSON-lines text; blank lines are skipped. Errors name `path` and the 1-based line.
pub fn parse_jsonl(text: &str, path: &Path) -> Result<Vec<TelemetryRecord>> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let rec: TelemetryRecord = serde_json::from_str(line).map_err(|e| {
            // serde_json's message ends with its own "at line 1 column C" (of this one line).
            let msg = e.to_string();
            let suffix = format!(" at line {} column {}", e.line(), e.column());
            let msg = msg.strip_suffix(&suffix).unwrap_or(&msg);
            Error::format(
                path,
                format!(
                    "line {}, column {}: not a telemetry record: {msg}",
                    n + 1,
                    e.column()
                ),
            )
        })?;
        rec.validate()
            .map_err(|e| Error::format(path, format!("line {}: {e}", n + 1)))?;
        out.push(rec);
    }
    Ok(out)
}

/// Reads a JSON-lines telemetry file.
pub fn read_jsonl(path: impl AsRef<Path>) -> Result<Vec<TelemetryRecord>> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let line = e.as_bytes()[..at].iter().filter(|&&c| c == b'\n').count() + 1;
        Error::format(path, format!("line {line}: not UTF-8 text"))
    })?;
    parse_jsonl(&text, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(extra: &str) -> String {
        format!(
            r#"{{"step":3,"layer":1,"sink_mass":[0.5,null],"sink_rate":1.0,"learned_sink_mass":null,"max_logit":[2.0,null],"entropy":[1.0,null],"valid_rows":[8,0],"out_abs_max":[3.0,0.0],"out_rms":[1.0,null],"out_outliers":[2,0]{extra}}}"#
        )
    }

    #[test]
    fn multi_rank_records_read_back_and_old_records_still_parse() {
        let path = Path::new("multi.jsonl");
        let text = format!("{}\n{}\n", line(r#","ranks":4,"tokens":32768"#), line(""));
        let recs = parse_jsonl(&text, path).expect("parse");
        assert_eq!((recs[0].ranks, recs[0].tokens), (Some(4), Some(32768)));
        assert_eq!((recs[1].ranks, recs[1].tokens), (None, None));
        // Written back: the fields round-trip, and records without them stay without them.
        let again = recs[0].to_json_line().expect("json");
        assert!(
            again.contains(r#""ranks":4"#) && again.contains(r#""tokens":32768"#),
            "{again}"
        );
        assert!(!recs[1].to_json_line().expect("json").contains("ranks"));
        assert_eq!(parse_jsonl(&again, path).expect("parse")[0], recs[0]);
        // Other unknown fields are ignored, as before.
        assert!(parse_jsonl(&line(r#","note":"x""#), path).is_ok());
        let e = parse_jsonl(&line(r#","ranks":0"#), path).expect_err("zero ranks");
        assert!(e.to_string().contains("ranks"), "{e}");
    }
}
