//! Reading trace files: good ones in both formats, and every kind of bad
//! one (truncated line, wrong types, negative or huge lengths, unsorted
//! timestamps, an empty file, ...) refused with an error that names the
//! line and the field, never a panic.

use std::time::Duration;

use kvlease_cli::trace::{parse, CsvColumns, Format, TimeUnit, Trace, TraceError};

fn mooncake(text: &str) -> Result<Trace, TraceError> {
    parse(text.as_bytes(), Format::Mooncake, &CsvColumns::default())
}

fn csv(text: &str) -> Result<Trace, TraceError> {
    parse(text.as_bytes(), Format::Csv, &CsvColumns::default())
}

/// Expects `r` to fail on `line` (None: the file) and `field`, with a
/// message containing `why`; the rendered message names both.
fn refused(r: Result<Trace, TraceError>, line: Option<usize>, field: Option<&str>, why: &str) {
    let e = r.expect_err("a bad trace was accepted");
    assert_eq!(e.line, line, "{e}");
    assert_eq!(e.field.as_deref(), field, "{e}");
    assert!(e.message.contains(why), "{e:?} does not say {why:?}");
    let shown = e.to_string();
    if let Some(l) = line {
        assert!(shown.contains(&format!("line {l}")), "{shown}");
    }
    if let Some(f) = field {
        assert!(shown.contains(f), "{shown}");
    }
}

#[test]
fn a_mooncake_file_reads_with_times_lengths_and_shared_prefixes() {
    let t = mooncake(
        "{\"timestamp\": 1000, \"input_length\": 1500, \"output_length\": 20, \"hash_ids\": [0, 1, 2]}\n\
         \n\
         {\"timestamp\": 1000, \"input_length\": 1400, \"output_length\": 0, \"hash_ids\": [0, 1, 5], \"extra\": true}\r\n\
         {\"timestamp\": 2500.5, \"input_length\": 7, \"output_length\": 3}\n",
    )
    .expect("a good file");
    assert_eq!(t.format, Format::Mooncake);
    assert!(t.has_prefixes);
    let r = &t.requests;
    assert_eq!(r.len(), 3);
    // Times from the first request, in seconds; the blank line is skipped.
    assert_eq!(r[0].at, Duration::ZERO);
    assert_eq!(r[1].at, Duration::ZERO);
    assert_eq!(r[2].at, Duration::from_micros(1_500_500));
    assert_eq!((r[0].input, r[0].output, r[0].line), (1500, 20, 1));
    assert_eq!((r[1].input, r[1].output, r[1].line), (1400, 0, 3));
    // Request 2 shares its first two blocks with request 1.
    assert_eq!((r[0].prefix_blocks, r[0].shared_blocks), (3, 0));
    assert_eq!((r[1].prefix_blocks, r[1].shared_blocks), (3, 2));
    assert_eq!((r[2].prefix_blocks, r[2].shared_blocks), (0, 0));
    assert_eq!(t.span(), Duration::from_micros(1_500_500));
}

#[test]
fn the_shipped_mooncake_traces_read_in_full() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/traces");
    for (file, requests, mean_input) in [
        ("mooncake_conversation.jsonl", 12_031, 12_035.0),
        ("mooncake_synthetic.jsonl", 3_993, 15_325.0),
    ] {
        let path = root.join(file);
        let t = kvlease_cli::trace::load(&path, None, &CsvColumns::default())
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(t.format, Format::Mooncake, "{file}");
        assert_eq!(t.requests.len(), requests, "{file}");
        let mean =
            t.requests.iter().map(|r| f64::from(r.input)).sum::<f64>() / t.requests.len() as f64;
        // The release notes' averages.
        assert!((mean - mean_input).abs() < 1.0, "{file}: mean input {mean}");
        // hash_ids are 512-token blocks: one per started 512 tokens.
        assert!(t
            .requests
            .iter()
            .all(|r| r.prefix_blocks == r.input.div_ceil(512)));
    }
}

#[test]
fn csv_traces_read_azure_and_burstgpt_shapes() {
    // Azure's LLM inference trace: date-time stamps, default column names.
    let t = csv("TIMESTAMP,ContextTokens,GeneratedTokens\n\
         2023-11-16 18:15:46.6805900,4808,10\n\
         2023-11-16 18:15:50.4078600,3180,8\n\
         2023-11-16 18:16:46.6805900,110,27\n")
    .expect("Azure shape");
    assert_eq!(t.format, Format::Csv);
    assert!(!t.has_prefixes);
    let at: Vec<u128> = t.requests.iter().map(|r| r.at.as_micros()).collect();
    assert_eq!(at, vec![0, 3_727_270, 60_000_000]);
    assert_eq!((t.requests[0].input, t.requests[0].output), (4808, 10));
    // BurstGPT: numeric seconds, columns with spaces, quoted fields.
    let t = csv(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n\
         5,\"ChatGPT, 3.5\",472,18,490,Conversation log\n\
         45.5,GPT-4,1087,0,1087,\"API \"\"log\"\"\"\n",
    )
    .expect("BurstGPT shape");
    assert_eq!(t.requests.len(), 2);
    assert_eq!(t.requests[1].at, Duration::from_millis(40_500));
    assert_eq!((t.requests[1].input, t.requests[1].output), (1087, 0));
    // Columns named by flags, milliseconds.
    let cols = CsvColumns {
        timestamp: Some("arrived_ms".into()),
        input: Some("in".into()),
        output: Some("out".into()),
        time_unit: TimeUnit::Ms,
    };
    let t = parse(
        b"in,out,arrived_ms\n10,1,100\n20,2,350\n",
        Format::Csv,
        &cols,
    )
    .expect("named columns");
    assert_eq!(t.requests[1].at, Duration::from_millis(250));
    assert_eq!(t.requests[1].input, 20);
}

#[test]
fn the_format_is_detected_from_the_name_or_the_first_character() {
    use std::path::Path;
    assert_eq!(Format::detect(Path::new("a.jsonl"), b"x"), Format::Mooncake);
    assert_eq!(Format::detect(Path::new("a.CSV"), b"{"), Format::Csv);
    assert_eq!(
        Format::detect(Path::new("trace"), b"  \n{\"a\":1}"),
        Format::Mooncake
    );
    assert_eq!(
        Format::detect(Path::new("trace"), b"TIMESTAMP,x"),
        Format::Csv
    );
}

#[test]
fn a_truncated_line_is_refused_with_its_number() {
    refused(
        mooncake(
            "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1}\n\
             {\"timestamp\": 5, \"input_length\": 10",
        ),
        Some(2),
        None,
        "truncated",
    );
    refused(
        mooncake("{\"timestamp\": 0, \"input_length\": 10,, \"output_length\": 1}"),
        Some(1),
        None,
        "not valid JSON at column",
    );
    refused(mooncake("[1, 2]"), Some(1), None, "expected a JSON object");
}

#[test]
fn wrong_types_name_the_field() {
    let line = |body: &str| {
        format!("{{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1}}\n{{{body}}}\n")
    };
    refused(
        mooncake(&line(
            r#""timestamp": 1, "input_length": "100", "output_length": 1"#,
        )),
        Some(2),
        Some("input_length"),
        "got the string \"100\"",
    );
    refused(
        mooncake(&line(
            r#""timestamp": null, "input_length": 100, "output_length": 1"#,
        )),
        Some(2),
        Some("timestamp"),
        "got null",
    );
    refused(
        mooncake(&line(
            r#""timestamp": 1, "input_length": 100, "output_length": [3]"#,
        )),
        Some(2),
        Some("output_length"),
        "got an array",
    );
    refused(
        mooncake(&line(
            r#""timestamp": 1, "input_length": 100.5, "output_length": 3"#,
        )),
        Some(2),
        Some("input_length"),
        "not a whole number",
    );
    refused(
        mooncake(&line(
            r#""timestamp": 1, "input_length": 100, "output_length": 3, "hash_ids": [1, "x"]"#,
        )),
        Some(2),
        Some("hash_ids"),
        "element 1",
    );
    refused(
        mooncake(&line(
            r#""timestamp": 1, "input_length": 100, "output_length": 3, "hash_ids": 7"#,
        )),
        Some(2),
        Some("hash_ids"),
        "expected an array",
    );
    refused(
        mooncake(&line(r#""timestamp": 1, "input_length": 100"#)),
        Some(2),
        Some("output_length"),
        "missing",
    );
}

#[test]
fn negative_zero_and_huge_lengths_are_refused() {
    let one = |body: &str| mooncake(&format!("{{{body}}}"));
    refused(
        one(r#""timestamp": 0, "input_length": -5, "output_length": 1"#),
        Some(1),
        Some("input_length"),
        "negative",
    );
    refused(
        one(r#""timestamp": 0, "input_length": 5, "output_length": -1"#),
        Some(1),
        Some("output_length"),
        "negative",
    );
    refused(
        one(r#""timestamp": 0, "input_length": 0, "output_length": 1"#),
        Some(1),
        Some("input_length"),
        "at least 1",
    );
    refused(
        one(r#""timestamp": 0, "input_length": 5000000, "output_length": 1"#),
        Some(1),
        Some("input_length"),
        "more than the 1048576",
    );
    refused(
        one(r#""timestamp": 0, "input_length": 5, "output_length": 18446744073709551615"#),
        Some(1),
        Some("output_length"),
        "more than",
    );
    refused(
        one(r#""timestamp": 1e300, "input_length": 5, "output_length": 1"#),
        Some(1),
        Some("timestamp"),
        "not a usable time",
    );
    refused(
        one(r#""timestamp": -3, "input_length": 5, "output_length": 1"#),
        Some(1),
        Some("timestamp"),
        "negative",
    );
    // More than ten days after the first request.
    refused(
        mooncake(
            "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}\n\
             {\"timestamp\": 900000000, \"input_length\": 5, \"output_length\": 1}",
        ),
        Some(2),
        Some("timestamp"),
        "at most 10 days",
    );
}

#[test]
fn unsorted_timestamps_are_refused_at_the_first_out_of_order_line() {
    refused(
        mooncake(
            "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}\n\
             {\"timestamp\": 700, \"input_length\": 5, \"output_length\": 1}\n\
             {\"timestamp\": 650, \"input_length\": 5, \"output_length\": 1}\n",
        ),
        Some(3),
        Some("timestamp"),
        "earlier than line 2",
    );
    refused(
        csv("time,input_tokens,output_tokens\n2,5,1\n1,5,1\n"),
        Some(3),
        Some("time"),
        "earlier than line 2",
    );
}

#[test]
fn an_empty_file_has_no_requests() {
    refused(mooncake(""), None, None, "no requests");
    refused(mooncake("\n  \n\n"), None, None, "no requests");
    refused(csv(""), None, None, "no requests");
    refused(
        csv("TIMESTAMP,ContextTokens,GeneratedTokens\n"),
        None,
        None,
        "no rows below its header",
    );
}

#[test]
fn bytes_that_are_not_text_are_refused_with_their_line() {
    let mut bytes = b"{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}\n".to_vec();
    bytes.extend_from_slice(&[0xff, 0xfe, b'\n']);
    refused(
        parse(&bytes, Format::Mooncake, &CsvColumns::default()),
        Some(2),
        None,
        "not UTF-8",
    );
}

#[test]
fn bad_csv_rows_name_the_line_and_the_column() {
    refused(
        csv("TIMESTAMP,Tokens,GeneratedTokens\n1,2,3\n"),
        Some(1),
        None,
        "no prompt-token column",
    );
    refused(
        csv("time,input_tokens,output_tokens\n1,5\n"),
        Some(2),
        None,
        "2 fields, but the header (line 1) has 3",
    );
    refused(
        csv("time,input_tokens,output_tokens\n1,five,1\n"),
        Some(2),
        Some("input_tokens"),
        "expected a token count",
    );
    refused(
        csv("time,input_tokens,output_tokens\n1,5,\n"),
        Some(2),
        Some("output_tokens"),
        "empty",
    );
    refused(
        csv("time,input_tokens,output_tokens\n1,-5,1\n"),
        Some(2),
        Some("input_tokens"),
        "negative",
    );
    refused(
        csv("time,input_tokens,output_tokens\n1,9999999,1\n"),
        Some(2),
        Some("input_tokens"),
        "more than",
    );
    refused(
        csv("time,input_tokens,output_tokens\n2023-02-30 00:00:00,5,1\n"),
        Some(2),
        Some("time"),
        "not in month 2",
    );
    refused(
        csv("time,input_tokens,output_tokens\n\"1,5,1\n"),
        Some(2),
        None,
        "never closes",
    );
    let cols = CsvColumns {
        timestamp: Some("when".into()),
        ..CsvColumns::default()
    };
    refused(
        parse(
            b"time,input_tokens,output_tokens\n1,5,1\n",
            Format::Csv,
            &cols,
        ),
        Some(1),
        None,
        "--csv-timestamp",
    );
}

#[test]
fn the_binary_names_the_file_line_and_field_and_does_not_panic() {
    let dir = std::env::temp_dir();
    let path = dir.join(format!("kvlease-bad-trace-{}.jsonl", std::process::id()));
    std::fs::write(
        &path,
        "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}\n\
         {\"timestamp\": 1, \"input_length\": \"lots\", \"output_length\": 1}\n",
    )
    .expect("write a temp file");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvlease"))
        .args(["sim", "--trace"])
        .arg(&path)
        .output()
        .expect("run kvlease");
    let _ = std::fs::remove_file(&path);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("line 2"), "{err}");
    assert!(err.contains("input_length"), "{err}");
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(out.stdout.is_empty());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvlease"))
        .args(["sim", "--trace", "/nonexistent/trace.jsonl"])
        .output()
        .expect("run kvlease");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/trace.jsonl"));
}
