//! CSV traces: the shape of public LLM serving traces.
//!
//! Owns reading a CSV file with a header row into requests: which columns
//! hold the arrival time and the prompt and output token counts (named by
//! `--csv-timestamp`, `--csv-input`, `--csv-output`; by default the first
//! of the usual names the header has, case-insensitively: Azure's
//! `TIMESTAMP`, `ContextTokens`, `GeneratedTokens`, BurstGPT's
//! `Timestamp`, `Request tokens`, `Response tokens`, and the
//! `input_length`/`output_length` style), and what a timestamp is: a number
//! in `--csv-time-unit` units, or a date-time `YYYY-MM-DD HH:MM:SS[.frac]`
//! (`T` for the space and a trailing `Z` accepted; UTC). Fields may be
//! quoted (`"a,b"`, `""` for a quote); a quoted field cannot span lines.
//! Written by hand: it is this much, and the `csv` crate would be a
//! dependency for it.

use super::{clip, lines, seconds, token_count, Builder, CsvColumns, TraceError};

const TIMESTAMP_NAMES: &[&str] = &["TIMESTAMP", "time", "arrival_time", "arrival_timestamp"];
const INPUT_NAMES: &[&str] = &[
    "ContextTokens",
    "Request tokens",
    "input_length",
    "input_tokens",
    "prompt_tokens",
    "context_tokens",
];
const OUTPUT_NAMES: &[&str] = &[
    "GeneratedTokens",
    "Response tokens",
    "output_length",
    "output_tokens",
    "completion_tokens",
    "generated_tokens",
];

/// Reads the header and every row of `bytes` into `b`.
pub(crate) fn parse(bytes: &[u8], cols: &CsvColumns, b: &mut Builder) -> Result<(), TraceError> {
    let mut rows = lines(bytes);
    let Some(first) = rows.next() else {
        return Err(TraceError::file(
            "no requests: the file is empty (a CSV trace needs a header row)",
        ));
    };
    let (header_line, header) = first?;
    let names = split(header).map_err(|e| TraceError::line(header_line, format!("header: {e}")))?;
    let find = |given: &Option<String>, defaults: &[&str], what: &str, flag: &str| {
        let wanted: Vec<&str> = match given {
            Some(g) => vec![g.as_str()],
            None => defaults.to_vec(),
        };
        for w in &wanted {
            if let Some(i) = names.iter().position(|n| n.trim().eq_ignore_ascii_case(w)) {
                return Ok((i, names[i].trim().to_string()));
            }
        }
        Err(TraceError::line(
            header_line,
            format!(
                "header: no {what} column (looked for {}; the header has {}); name it with {flag}",
                wanted
                    .iter()
                    .map(|w| format!("{w:?}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                names
                    .iter()
                    .map(|n| format!("{:?}", clip(n.trim())))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ))
    };
    let (ti, t_name) = find(
        &cols.timestamp,
        TIMESTAMP_NAMES,
        "timestamp",
        "--csv-timestamp",
    )?;
    let (ii, i_name) = find(&cols.input, INPUT_NAMES, "prompt-token", "--csv-input")?;
    let (oi, o_name) = find(&cols.output, OUTPUT_NAMES, "output-token", "--csv-output")?;
    let unit_s = cols.time_unit.seconds();
    for item in rows {
        let (line, text) = item?;
        let fields = split(text).map_err(|e| TraceError::line(line, e))?;
        if fields.len() != names.len() {
            return Err(TraceError::line(
                line,
                format!(
                    "{} fields, but the header (line {header_line}) has {}",
                    fields.len(),
                    names.len()
                ),
            ));
        }
        let t_text = fields[ti].trim();
        let t_s = match t_text.parse::<f64>() {
            Ok(x) => seconds(line, &t_name, x, unit_s, t_text)?,
            Err(_) => date_time(t_text).map_err(|e| {
                TraceError::field(
                    line,
                    &t_name,
                    format!(
                        "{:?} is neither a number nor a date-time YYYY-MM-DD HH:MM:SS[.frac] ({e})",
                        clip(t_text)
                    ),
                )
            })?,
        };
        let input = count(line, &i_name, fields[ii].trim(), 1)?;
        let output = count(line, &o_name, fields[oi].trim(), 0)?;
        b.push(line, &t_name, t_s, input, output, None)?;
    }
    Ok(())
}

/// A token count field.
fn count(line: usize, field: &str, text: &str, min: u32) -> Result<u32, TraceError> {
    match text.parse::<f64>() {
        Ok(x) => token_count(line, field, x, text, min),
        Err(_) if text.is_empty() => Err(TraceError::field(line, field, "empty")),
        Err(_) => Err(TraceError::field(
            line,
            field,
            format!("expected a token count, got {:?}", clip(text)),
        )),
    }
}

/// The fields of one CSV line.
fn split(line: &str) -> Result<Vec<String>, String> {
    let mut fields = Vec::new();
    let mut chars = line.chars().peekable();
    loop {
        let mut field = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            loop {
                match chars.next() {
                    None => {
                        return Err(format!(
                            "field {} opens a quote that the line never closes",
                            fields.len() + 1
                        ))
                    }
                    Some('"') if chars.peek() == Some(&'"') => {
                        chars.next();
                        field.push('"');
                    }
                    Some('"') => break,
                    Some(c) => field.push(c),
                }
            }
            match chars.next() {
                None => {
                    fields.push(field);
                    return Ok(fields);
                }
                Some(',') => {}
                Some(c) => {
                    return Err(format!(
                        "field {}: {c:?} after a closing quote (expected a comma)",
                        fields.len() + 1
                    ))
                }
            }
        } else {
            loop {
                match chars.next() {
                    None => {
                        fields.push(field);
                        return Ok(fields);
                    }
                    Some(',') => break,
                    Some(c) => field.push(c),
                }
            }
        }
        fields.push(field);
    }
}

/// Seconds since 1970-01-01 of `YYYY-MM-DD[ T]HH:MM:SS[.frac][Z]` (UTC).
fn date_time(s: &str) -> Result<f64, String> {
    let s = s.strip_suffix('Z').unwrap_or(s);
    let s = s.strip_suffix("+00:00").unwrap_or(s);
    let (date, time) = s
        .split_once([' ', 'T'])
        .ok_or("no space or T between date and time")?;
    let mut d = date.split('-');
    let (Some(y), Some(mo), Some(da), None) = (d.next(), d.next(), d.next(), d.next()) else {
        return Err("the date is not YYYY-MM-DD".into());
    };
    let num = |x: &str, what: &str| -> Result<u32, String> {
        if x.is_empty() || x.len() > 4 || !x.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("bad {what} {x:?}"));
        }
        x.parse().map_err(|_| format!("bad {what} {x:?}"))
    };
    let (y, mo, da) = (num(y, "year")?, num(mo, "month")?, num(da, "day")?);
    if y < 1970 {
        return Err(format!("year {y} is before 1970"));
    }
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let days_in = match mo {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return Err(format!("month {mo} is not 1-12")),
    };
    if da == 0 || da > days_in {
        return Err(format!("day {da} is not in month {mo}"));
    }
    let mut t = time.split(':');
    let (Some(h), Some(mi), Some(sec), None) = (t.next(), t.next(), t.next(), t.next()) else {
        return Err("the time is not HH:MM:SS".into());
    };
    let (h, mi) = (num(h, "hour")?, num(mi, "minute")?);
    let (whole, frac) = sec.split_once('.').unwrap_or((sec, ""));
    let whole = num(whole, "second")?;
    if h > 23 || mi > 59 || whole > 60 {
        return Err(format!("{h}:{mi}:{whole} is not a time of day"));
    }
    let frac = if frac.is_empty() {
        0.0
    } else if frac.len() <= 9 && frac.bytes().all(|b| b.is_ascii_digit()) {
        format!("0.{frac}")
            .parse::<f64>()
            .map_err(|e| e.to_string())?
    } else {
        return Err(format!("bad fraction of a second {frac:?}"));
    };
    let days = days_from_civil(i64::from(y), mo, da);
    let secs = days * 86_400 + i64::from(h) * 3600 + i64::from(mi) * 60 + i64::from(whole);
    Ok(secs as f64 + frac)
}

/// Days from 1970-01-01 to the proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = i64::from((m + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::{date_time, split};

    #[test]
    fn quoted_fields_and_commas_inside_them() {
        assert_eq!(split("a,\"b,c\",d").unwrap(), vec!["a", "b,c", "d"]);
        assert_eq!(split("\"x\"\"y\",").unwrap(), vec!["x\"y", ""]);
        assert!(split("a,\"b").unwrap_err().contains("never closes"));
        assert!(split("\"a\"b,c")
            .unwrap_err()
            .contains("after a closing quote"));
    }

    #[test]
    fn date_times_are_utc_seconds_since_1970() {
        assert_eq!(date_time("1970-01-01 00:00:00").unwrap(), 0.0);
        assert_eq!(date_time("1970-01-02T00:00:01Z").unwrap(), 86_401.0);
        // 2023-11-16 is day 19,677 since 1970 (a leap-day-crossing check).
        let t = date_time("2023-11-16 18:15:46.6805900").unwrap();
        assert!(
            (t - (19_677.0 * 86_400.0 + 65_746.680_59)).abs() < 1e-4,
            "{t}"
        );
        assert_eq!(
            date_time("2024-03-01 00:00:00").unwrap() - date_time("2024-02-28 00:00:00").unwrap(),
            2.0 * 86_400.0
        );
        assert!(date_time("2023-02-29 00:00:00").is_err());
        assert!(date_time("2023-13-01 00:00:00").is_err());
        assert!(date_time("2023-01-01 24:00:00").is_err());
        assert!(date_time("yesterday").is_err());
    }
}
