//! The policies compared side by side, and how each is realised with the
//! library.
//!
//! This module owns the mapping from a policy to the library's settings
//! and the D engine's behaviour. Every policy runs the same engines, the
//! same roles and the same bytes; only these knobs differ:
//!
//! | policy | P lease (`kv_lease_duration`) | D heartbeats | slots and verification |
//! |---|---|---|---|
//! | `lease+verify` | the configured one (30 s by default) | yes | yes |
//! | `lease-noverify` | the configured one | yes | no (`kv_lease_verification = false`) |
//! | `fixed-480` | 480 s | no | no |
//! | `fixed-30` | 30 s | no | no |
//!
//! A fixed timeout is vLLM before leases (`VLLM_NIXL_ABORT_REQUEST_TIMEOUT`):
//! P holds the blocks until D's read-done or the deadline. The library
//! realises it exactly: a lease of that length that nobody renews (the D
//! tracker is never told about the request, so no heartbeat is sent), and
//! no slot or nonce (D pulls without verifying, as vLLM did).

use std::time::Duration;

use clap::ValueEnum;
use kvlease::LeaseConfig;
use serde::Serialize;

/// A lease policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, ValueEnum, Serialize)]
pub enum Policy {
    /// Lease renewal by heartbeats, and D verifies the lease after its READ.
    #[value(name = "lease+verify")]
    #[serde(rename = "lease+verify")]
    LeaseVerify,
    /// Lease renewal by heartbeats, no verification.
    #[value(name = "lease-noverify")]
    #[serde(rename = "lease-noverify")]
    LeaseNoVerify,
    /// A fixed 480 s timeout, no heartbeats (vLLM before leases).
    #[value(name = "fixed-480")]
    #[serde(rename = "fixed-480")]
    Fixed480,
    /// A fixed 30 s timeout, no heartbeats.
    #[value(name = "fixed-30")]
    #[serde(rename = "fixed-30")]
    Fixed30,
}

/// What a policy turns into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Realised {
    /// The lease settings every P and D engine is built with.
    pub config: LeaseConfig,
    /// D's scheduler tracks requests and its workers heartbeat.
    pub heartbeats: bool,
}

impl Policy {
    /// Every policy, in table order.
    pub const ALL: [Policy; 4] = [
        Policy::LeaseVerify,
        Policy::LeaseNoVerify,
        Policy::Fixed480,
        Policy::Fixed30,
    ];

    /// The name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Policy::LeaseVerify => "lease+verify",
            Policy::LeaseNoVerify => "lease-noverify",
            Policy::Fixed480 => "fixed-480",
            Policy::Fixed30 => "fixed-30",
        }
    }

    /// Whether the policy renews leases (so `--sweep kv_lease_duration`
    /// changes it; the fixed ones stay fixed).
    pub fn renews(self) -> bool {
        matches!(self, Policy::LeaseVerify | Policy::LeaseNoVerify)
    }

    /// The policy on top of the configured lease settings `base`.
    pub fn realise(self, base: &LeaseConfig) -> Realised {
        let mut config = base.clone();
        let fixed = |c: &mut LeaseConfig, secs: u64| {
            c.lease_duration = Duration::from_secs(secs);
            c.verification = false;
            // A cap on heartbeat renewal means nothing without heartbeats,
            // and must not be shorter than the timeout it would cap.
            c.max_hold_secs = None;
        };
        let heartbeats = match self {
            Policy::LeaseVerify => {
                config.verification = true;
                true
            }
            Policy::LeaseNoVerify => {
                config.verification = false;
                true
            }
            Policy::Fixed480 => {
                fixed(&mut config, 480);
                false
            }
            Policy::Fixed30 => {
                fixed(&mut config, 30);
                false
            }
        };
        Realised { config, heartbeats }
    }
}

#[cfg(test)]
mod tests {
    use super::Policy;
    use kvlease::{EngineShape, LeaseConfig};
    use std::time::Duration;

    #[test]
    fn fixed_policies_are_unrenewed_unverified_leases_of_their_length() {
        let base = LeaseConfig::new(EngineShape {
            num_kv_blocks: 64,
            max_num_seqs: 8,
        });
        let f = Policy::Fixed480.realise(&base);
        assert!(!f.heartbeats && !f.config.verification);
        assert_eq!(f.config.lease_duration, Duration::from_secs(480));
        assert!(f.config.validate().is_ok());
        let l = Policy::LeaseVerify.realise(&base);
        assert!(l.heartbeats && l.config.verification);
        assert_eq!(l.config.lease_duration, base.lease_duration);
        assert!(!Policy::LeaseNoVerify.realise(&base).config.verification);
    }
}
