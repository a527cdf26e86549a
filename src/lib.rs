//! kvlease (crate docs are filled in below as the modules land).
#![deny(missing_docs)]
#![forbid(unsafe_op_in_unsafe_fn)]

pub mod config;
mod sync;
pub mod time;

pub use config::{ConfigError, EngineShape, LeaseConfig, ParsedConfig};
pub use time::{Instant, MonotonicClock};
