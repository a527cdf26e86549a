//! Request traces: real traffic for `kvlease sim --trace FILE`.
//!
//! This module tree owns reading a trace file into a [`Trace`] (arrival
//! times and token lengths, checked) and everything derived from the trace
//! alone: the replay window, speed and load scale ([`window`]), its load
//! figures ([`stats`]), the faults laid over it ([`overlay`]) and the rules
//! that size a fleet for it ([`sizing`]). It runs no simulation:
//! [`crate::sim`] replays the arrivals it yields, and [`crate::args`] runs
//! `--auto-size`'s sizing replay.
//!
//! Two formats ([`Format`]):
//!
//! - [`mooncake`]: Mooncake's JSONL, one object per line with `timestamp`
//!   (ms), `input_length`, `output_length` and `hash_ids` (ids of the
//!   prompt's 512-token prefix blocks; equal leading ids are a shared prefix);
//! - [`csv`]: the shape of public LLM serving traces (Azure's
//!   `TIMESTAMP,ContextTokens,GeneratedTokens`, BurstGPT's `Timestamp,...,
//!   Request tokens,Response tokens,...`): a header row, a timestamp column
//!   and the context and generated token columns, named by flags.
//!
//! A trace is outside input: every field is checked (see [`TraceError`]);
//! times are kept relative to the first request's.

pub mod csv;
pub mod error;
pub mod mooncake;
pub mod overlay;
pub mod sizing;
pub mod stats;
pub mod window;

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use clap::ValueEnum;
use serde::Serialize;

pub use error::TraceError;

/// Most tokens one request may have, prompt or output: far above any
/// model's context today (Mooncake's largest prompt is 191,378 tokens), low
/// enough that block arithmetic cannot overflow.
pub const MAX_TOKENS: u32 = 1 << 20;

/// Longest trace, first request to last: ten days (`--duration`'s limit).
pub const MAX_SPAN: Duration = Duration::from_secs(10 * 24 * 3600);

/// Tokens per prefix block in Mooncake's `hash_ids` (the release notes').
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

/// A trace file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    /// Mooncake's JSONL.
    Mooncake,
    /// CSV with a header row.
    Csv,
}

impl Format {
    /// The name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Format::Mooncake => "mooncake",
            Format::Csv => "csv",
        }
    }

    /// The format of `path` with contents `bytes`: by extension (`.jsonl`,
    /// `.json`, `.ndjson`; `.csv`), else by the first character that is
    /// not white space (`{` is JSONL).
    pub fn detect(path: &Path, bytes: &[u8]) -> Format {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("jsonl" | "json" | "ndjson") => return Format::Mooncake,
            Some("csv") => return Format::Csv,
            _ => {}
        }
        match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
            Some(b'{') => Format::Mooncake,
            _ => Format::Csv,
        }
    }
}

/// The unit of numeric CSV timestamps (date-time strings carry their own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum TimeUnit {
    /// Seconds.
    #[default]
    S,
    /// Milliseconds.
    Ms,
    /// Microseconds.
    Us,
}

impl TimeUnit {
    /// Seconds per unit.
    pub fn seconds(self) -> f64 {
        match self {
            TimeUnit::S => 1.0,
            TimeUnit::Ms => 1e-3,
            TimeUnit::Us => 1e-6,
        }
    }
}

/// How to read a CSV trace: the columns (`None`: the first of the usual
/// names that the header has) and the unit of numeric timestamps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CsvColumns {
    /// The arrival-time column.
    pub timestamp: Option<String>,
    /// The prompt (context) token column.
    pub input: Option<String>,
    /// The generated (output) token column.
    pub output: Option<String>,
    /// The unit of numeric timestamps.
    pub time_unit: TimeUnit,
}

/// One request of a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceRequest {
    /// Arrival, since the trace's first request.
    pub at: Duration,
    /// Prompt tokens.
    pub input: u32,
    /// Output tokens.
    pub output: u32,
    /// Prefix blocks (`hash_ids`) the trace gives for the prompt.
    pub prefix_blocks: u32,
    /// Of those, the leading ones an earlier request of the file already had
    /// (a prefix cache could have reused them).
    pub shared_blocks: u32,
    /// The line it came from (1-based).
    pub line: usize,
}

/// A checked trace: requests in arrival order, times from the first.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    /// The format it was read as.
    pub format: Format,
    /// The requests, sorted by arrival.
    pub requests: Vec<TraceRequest>,
    /// Whether the file gives prefix blocks (`hash_ids`).
    pub has_prefixes: bool,
}

impl Trace {
    /// From the first request to the last.
    pub fn span(&self) -> Duration {
        self.requests.last().map_or(Duration::ZERO, |r| r.at)
    }
}

/// What a report says about a replay: the file, the window, the traffic,
/// the faults laid over it and the fleet `--auto-size` chose.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TraceInfo {
    /// The file, as given.
    pub file: String,
    /// Its format.
    pub format: Format,
    /// Window start, trace seconds.
    pub from_s: f64,
    /// Window end, trace seconds (`None`: the end).
    pub to_s: Option<f64>,
    /// Trace seconds per run second.
    pub speed: f64,
    /// Load multiplier.
    pub rate_scale: f64,
    /// Tokens per KV block.
    pub block_tokens: u32,
    /// The replayed traffic.
    pub stats: stats::TraceStats,
    /// The faults, as placed on the run.
    pub faults: Vec<overlay::PlacedFault>,
    /// The fleet `--auto-size` chose, and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sizing: Option<sizing::Sizing>,
}

/// Reads `path` as `format` (`None`: detect it).
pub fn load(path: &Path, format: Option<Format>, csv: &CsvColumns) -> Result<Trace, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("--trace {}: {e}", path.display()))?;
    let format = format.unwrap_or_else(|| Format::detect(path, &bytes));
    parse(&bytes, format, csv)
        .map_err(|e| format!("--trace {} ({} format): {e}", path.display(), format.name()))
}

/// Parses the bytes of a trace file.
pub fn parse(bytes: &[u8], format: Format, csv: &CsvColumns) -> Result<Trace, TraceError> {
    let mut b = Builder::new(format);
    match format {
        Format::Mooncake => mooncake::parse(bytes, &mut b)?,
        Format::Csv => csv::parse(bytes, csv, &mut b)?,
    }
    b.finish()
}

/// The lines of `bytes` with their 1-based numbers, as text, blank ones
/// skipped; a line that is not UTF-8 is an error naming it.
pub(crate) fn lines(bytes: &[u8]) -> impl Iterator<Item = Result<(usize, &str), TraceError>> {
    bytes
        .split(|&b| b == b'\n')
        .enumerate()
        .filter_map(|(i, raw)| match std::str::from_utf8(raw) {
            Ok(s) if s.trim().is_empty() => None,
            Ok(s) => Some(Ok((i + 1, s.trim()))),
            Err(e) => Some(Err(TraceError::line(
                i + 1,
                format!("not UTF-8 text (byte {})", e.valid_up_to() + 1),
            ))),
        })
}

/// Collects requests in file order and checks what no single field shows:
/// times in order, the span, the prefix statistics.
pub(crate) struct Builder {
    format: Format,
    requests: Vec<TraceRequest>,
    first_s: Option<f64>,
    last: (f64, usize),
    seen: HashSet<u64>,
    has_prefixes: bool,
}

impl Builder {
    fn new(format: Format) -> Builder {
        Builder {
            format,
            requests: Vec::new(),
            first_s: None,
            last: (f64::NEG_INFINITY, 0),
            seen: HashSet::new(),
            has_prefixes: false,
        }
    }

    /// Adds the request of line `line`: arrival `t_s` (seconds, on the
    /// file's own clock, finite and not negative), its lengths (checked by
    /// the caller) and its prefix block ids, if the format has them.
    /// `field` names the time field for errors.
    pub(crate) fn push(
        &mut self,
        line: usize,
        field: &str,
        t_s: f64,
        input: u32,
        output: u32,
        prefix: Option<&[u64]>,
    ) -> Result<(), TraceError> {
        debug_assert!(t_s.is_finite() && t_s >= 0.0);
        let (last_s, last_line) = self.last;
        if t_s < last_s {
            return Err(TraceError::field(
                line,
                field,
                format!(
                    "{} is earlier than line {last_line}'s {}: requests must be in arrival order",
                    show_s(t_s),
                    show_s(last_s)
                ),
            ));
        }
        self.last = (t_s, line);
        let first = *self.first_s.get_or_insert(t_s);
        let rel = t_s - first;
        if rel > MAX_SPAN.as_secs_f64() {
            return Err(TraceError::field(
                line,
                field,
                format!(
                    "{} after the first request: a trace may span at most {} days",
                    show_s(rel),
                    MAX_SPAN.as_secs() / 86_400
                ),
            ));
        }
        let (mut prefix_blocks, mut shared_blocks) = (0u32, 0u32);
        if let Some(ids) = prefix {
            self.has_prefixes = true;
            prefix_blocks = u32::try_from(ids.len()).unwrap_or(u32::MAX);
            let mut leading = true;
            for id in ids {
                let known = !self.seen.insert(*id);
                leading &= known;
                if leading {
                    shared_blocks += 1;
                }
            }
        }
        self.requests.push(TraceRequest {
            at: Duration::from_secs_f64(rel),
            input,
            output,
            prefix_blocks,
            shared_blocks,
            line,
        });
        Ok(())
    }

    fn finish(self) -> Result<Trace, TraceError> {
        if self.requests.is_empty() {
            return Err(TraceError::file(match self.format {
                Format::Mooncake => "no requests: the file has no JSON lines",
                Format::Csv => "no requests: the file has no rows below its header",
            }));
        }
        Ok(Trace {
            format: self.format,
            requests: self.requests,
            has_prefixes: self.has_prefixes,
        })
    }
}

/// A time in seconds for messages.
fn show_s(s: f64) -> String {
    format!("{s:.3} s")
}

/// What a JSON value is, for "expected X, got Y" messages.
pub(crate) fn describe(v: &serde_json::Value) -> String {
    use serde_json::Value;
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => format!("the string {:?}", clip(s)),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// At most 40 characters of `s`, for messages.
pub(crate) fn clip(s: &str) -> String {
    if s.chars().count() <= 40 {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(40).collect();
        t.push_str("...");
        t
    }
}

/// A token count from a number `x` (as written, `text`): whole, in
/// `min..=MAX_TOKENS`.
pub(crate) fn token_count(
    line: usize,
    field: &str,
    x: f64,
    text: &str,
    min: u32,
) -> Result<u32, TraceError> {
    if !x.is_finite() {
        return Err(TraceError::field(
            line,
            field,
            format!("{text} is not a token count"),
        ));
    }
    if x < 0.0 {
        return Err(TraceError::field(
            line,
            field,
            format!("negative token count {text}"),
        ));
    }
    if x.fract() != 0.0 {
        return Err(TraceError::field(
            line,
            field,
            format!("{text} is not a whole number of tokens"),
        ));
    }
    if x > f64::from(MAX_TOKENS) {
        return Err(TraceError::field(
            line,
            field,
            format!("{text} tokens is more than the {MAX_TOKENS} one request may have"),
        ));
    }
    let n = x as u32;
    if n < min {
        return Err(TraceError::field(
            line,
            field,
            format!("{n} tokens: a request needs at least {min}"),
        ));
    }
    Ok(n)
}

/// A timestamp in seconds from a number `x` in units of `unit_s` seconds
/// (as written, `text`): finite, not negative, not absurd.
pub(crate) fn seconds(
    line: usize,
    field: &str,
    x: f64,
    unit_s: f64,
    text: &str,
) -> Result<f64, TraceError> {
    // 1e12 s is 31,700 years: beyond any epoch a trace would use, and small
    // enough that differences of two stay exact to well under a millisecond.
    let s = x * unit_s;
    if !s.is_finite() || s > 1e12 {
        return Err(TraceError::field(
            line,
            field,
            format!("{text} is not a usable time"),
        ));
    }
    if s < 0.0 {
        return Err(TraceError::field(
            line,
            field,
            format!("negative time {text}"),
        ));
    }
    Ok(s)
}
