//! `kvlease`: the command line. `kvlease sim --help` explains every flag.

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use kvlease_cli::app;
use kvlease_cli::args::{Cli, Command};

fn main() -> ExitCode {
    // Bad flags: clap prints the error (or --help) and picks the exit code.
    let cli = Cli::parse();
    match cli.command {
        Command::Sim(args) => match app::sim(&args) {
            Ok(out) => {
                eprint!("{}", out.stderr);
                // A closed pipe (`| head`) is not an error worth a panic.
                let _ = std::io::stdout().write_all(out.stdout.as_bytes());
                ExitCode::SUCCESS
            }
            Err(msg) => {
                eprintln!("error: {msg}");
                ExitCode::from(2)
            }
        },
    }
}
