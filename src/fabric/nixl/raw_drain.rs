//! [`drain_raw_notifications`]: an agent's notifications as raw bytes,
//! whatever they hold. The fabric drains its own agent with it, and an
//! engine that owns its agent ([`NixlFabric::with_agent`]) drains with it
//! too. It owns nothing but that call: it keeps no state, and touches the
//! agent only through `get_notifications`.
//!
//! Why it exists: `nixl-sys`'s [`NotificationMap::take_notifs`], the only
//! call that empties a map, converts every message to a `String` and fails
//! on one that is not UTF-8, leaving the map full; an engine that drains
//! with it then sees the same failure at every later drain, and every
//! notification behind the bad one is stuck. kvlease's compact heartbeats
//! are text, but a peer may send anything.

use super::*;

/// What one [`drain_raw_notifications`] call did.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RawDrain {
    /// Notifications handed to the sink.
    pub delivered: usize,
    /// `take_notifs` refused the map (a message or a sender name that is not
    /// UTF-8), so the messages were read one by one and the map replaced
    /// with a new one: the only way `nixl-sys` offers to empty it.
    pub map_replaced: bool,
    /// Senders whose agent name is not UTF-8. `nixl-sys` looks messages up
    /// by `&str` only, so theirs could not be read; they were dropped with
    /// the map.
    pub senders_skipped: usize,
}

/// Takes every notification `agent` has received into `map` and hands each
/// to `sink` as (sender's agent name, bytes), in arrival order per sender.
/// Survives messages that are not UTF-8 (see the module docs). `map` is
/// empty on return, ready for the next call; it may be a new map.
///
/// Allocates (`nixl-sys` builds strings and vectors for the messages) but
/// not when nothing arrived. Errors are `nixl-sys`'s; after one, the
/// messages not yet handed to `sink` stay in `map` for the next call.
pub fn drain_raw_notifications(
    agent: &Agent,
    map: &mut NotificationMap,
    sink: &mut dyn FnMut(&str, &[u8]),
) -> Result<RawDrain, NixlError> {
    agent.get_notifications(map, None)?;
    let mut report = RawDrain::default();
    if map.is_empty()? {
        return Ok(report);
    }
    if let Ok(all) = map.take_notifs() {
        for (sender, msgs) in &all {
            for m in msgs {
                sink(sender, m.as_bytes());
                report.delivered += 1;
            }
        }
        return Ok(report);
    }
    // Hand out the bytes as they are, then replace the map. A fresh map is
    // made first, so that a failure leaves the old one (and its messages)
    // in place rather than delivering them twice.
    let fresh = NotificationMap::new()?;
    for sender in map.agents() {
        let Ok(sender) = sender else {
            report.senders_skipped += 1;
            continue;
        };
        let Ok(msgs) = map.get_notifications(sender) else {
            continue;
        };
        for m in msgs.flatten() {
            sink(sender, &m);
            report.delivered += 1;
        }
    }
    *map = fresh;
    report.map_replaced = true;
    Ok(report)
}
