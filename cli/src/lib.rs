//! The `kvlease` command line (`kvlease sim`), as a library so that its
//! integration tests can drive the simulator directly.
//!
//! - [`sim`]: the simulated deployment (engines, router, faults, metrics);
//! - [`trace`]: request traces (`--trace`): reading, windows, faults laid
//!   over them, the fleet sized for them;
//! - [`report`]: the terminal table, JSON, the SVG plot, the sweep table;
//! - [`args`]: the command line: flags and their help;
//! - [`settings`]: what the flags yield, checked together;
//! - [`runner`]: running many (scenario, policy) pairs with a progress bar;
//! - [`app`]: one invocation, from flags to output.

pub mod app;
pub mod args;
pub mod report;
pub mod runner;
pub mod settings;
pub mod sim;
pub mod trace;
