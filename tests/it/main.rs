//! The integration tests, one binary (`cargo test --test it`): one module
//! per former test file, named as before, so a filter by module selects
//! what a `--test` flag used to (`cargo test --test it -- nixl_fabric::`).
//!
//! What is not here: the zero-allocation tests (`tests/*_alloc.rs`). Each
//! installs the counting global allocator, so each stays a binary of its
//! own. Shared helpers live in `tests/support/`, the shared fake fabric and
//! test generator in the library's `testkit`.
//!
//! Some tests re-execute this binary to run one test as a child process;
//! they name it with [`support::exact_test_name`], which includes the module
//! path libtest prints.

#[path = "../support/mod.rs"]
mod support;

// Shared by several test modules below.
mod cluster;
mod embed;
mod protocol;

mod book_model;
mod clock_offset;
mod cluster_loopback;
mod cluster_nixl;
mod consumer_loopback;
mod consumer_sender;
mod consumer_tracker;
mod d_roles;
mod d_roles_loopback;
mod decoder_cache;
mod embed_loopback;
mod embed_nixl;
mod lease_invariants;
mod loopback_fabric;
mod nixl_fabric;
mod owed_plan;
mod protocol_loopback;
mod protocol_nixl;
mod read_done_consumers;
mod stuck_leases;
mod topologies;
mod turn2_loopback;
mod turn2_nixl;
mod two_hosts;
