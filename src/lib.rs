//! kvlease (crate docs are filled in below as the modules land).
#![deny(missing_docs)]
#![forbid(unsafe_op_in_unsafe_fn)]

pub mod config;
pub mod fabric;
pub mod ids;
mod sync;
pub mod time;
pub mod topology;
pub mod wheel;

pub use config::{ConfigError, EngineShape, LeaseConfig, ParsedConfig};
pub use fabric::{Fabric, FabricError};
pub use time::{Instant, MonotonicClock};
pub mod nonce;
pub mod producer;
pub mod slot_pool;
pub mod slots;
#[cfg(any(test, feature = "testkit"))]
#[doc(hidden)]
pub mod testkit;
pub mod wire;

pub use nonce::{Nonce, NonceSource};
pub use producer::{BookCounters, Grant, GrantError, LeaseBook, ReleaseReason, Released, Renewal};
pub use slot_pool::{SlotPool, SlotTicket};
pub use slots::LeaseSlots;
