//! Mooncake's JSONL trace format (the FAST'25 release of kvcache-ai/Mooncake).
//!
//! Owns reading one line into one request. A line is a JSON object:
//! `timestamp` (milliseconds from the trace's start, a number), then
//! `input_length` and `output_length` (token counts) and `hash_ids` (the
//! prompt's 512-token prefix blocks as ids; optional). Other keys are
//! ignored. Blank lines are skipped. Every other departure is an error
//! naming the line and the key.

use serde_json::{Map, Value};

use super::{describe, lines, seconds, token_count, Builder, TraceError};

const TIMESTAMP: &str = "timestamp";
const INPUT: &str = "input_length";
const OUTPUT: &str = "output_length";
const HASH_IDS: &str = "hash_ids";

/// Reads every line of `bytes` into `b`.
pub(crate) fn parse(bytes: &[u8], b: &mut Builder) -> Result<(), TraceError> {
    let mut ids: Vec<u64> = Vec::new();
    for item in lines(bytes) {
        let (line, text) = item?;
        let value: Value = serde_json::from_str(text).map_err(|e| json_error(line, &e))?;
        let Value::Object(obj) = value else {
            return Err(TraceError::line(
                line,
                format!("expected a JSON object, got {}", describe(&value)),
            ));
        };
        let (t, t_text) = number(line, &obj, TIMESTAMP)?;
        let t_s = seconds(line, TIMESTAMP, t, 1e-3, &t_text)?;
        let (x, text) = number(line, &obj, INPUT)?;
        let input = token_count(line, INPUT, x, &text, 1)?;
        let (x, text) = number(line, &obj, OUTPUT)?;
        let output = token_count(line, OUTPUT, x, &text, 0)?;
        let prefix = match obj.get(HASH_IDS) {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) => {
                ids.clear();
                for (k, v) in a.iter().enumerate() {
                    match v.as_u64() {
                        Some(id) => ids.push(id),
                        None => {
                            return Err(TraceError::field(
                                line,
                                HASH_IDS,
                                format!(
                                    "element {k} is {}: expected a non-negative whole number",
                                    describe(v)
                                ),
                            ))
                        }
                    }
                }
                Some(ids.as_slice())
            }
            Some(v) => {
                return Err(TraceError::field(
                    line,
                    HASH_IDS,
                    format!("expected an array of block ids, got {}", describe(v)),
                ))
            }
        };
        b.push(line, TIMESTAMP, t_s, input, output, prefix)?;
    }
    Ok(())
}

/// The number at `key`, with its text for messages.
fn number(line: usize, obj: &Map<String, Value>, key: &str) -> Result<(f64, String), TraceError> {
    match obj.get(key) {
        None => Err(TraceError::field(line, key, "missing")),
        Some(Value::Number(n)) => match n.as_f64() {
            Some(x) => Ok((x, n.to_string())),
            None => Err(TraceError::field(line, key, format!("{n} is not a number"))),
        },
        Some(v) => Err(TraceError::field(
            line,
            key,
            format!("expected a number, got {}", describe(v)),
        )),
    }
}

/// A line that is not JSON: truncated, or malformed at a column.
fn json_error(line: usize, e: &serde_json::Error) -> TraceError {
    // serde_json's message ends "at line 1 column N": the line is ours to name.
    let msg = e.to_string();
    let msg = msg.rfind(" at line ").map_or(msg.as_str(), |i| &msg[..i]);
    let what = if e.is_eof() {
        format!(
            "truncated: the line ends inside its JSON object (column {}: {msg})",
            e.column()
        )
    } else {
        format!("not valid JSON at column {}: {msg}", e.column())
    };
    TraceError::line(line, what)
}
