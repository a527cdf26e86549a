//! [`PeerAddress`]: how the sender turns (P engine, rank) into the address
//! its fabric handshakes with.

use super::*;

/// Formats the fabric address of P rank `rank` of `engine`.
pub trait PeerAddress {
    /// Writes the address; an error (or a buffer overflow) makes the
    /// handshake attempt fail with [`FabricError::BadAddress`].
    fn write_address(
        &self,
        engine: &EngineKey<'_>,
        rank: u32,
        out: &mut dyn fmt::Write,
    ) -> fmt::Result;
}

impl<F> PeerAddress for F
where
    F: Fn(&EngineKey<'_>, u32, &mut dyn fmt::Write) -> fmt::Result,
{
    fn write_address(
        &self,
        engine: &EngineKey<'_>,
        rank: u32,
        out: &mut dyn fmt::Write,
    ) -> fmt::Result {
        self(engine, rank, out)
    }
}

/// `{host}:{port}/{engine_id}/{rank}`, e.g. `10.0.0.7:5600/prefill-0/3`:
/// names every (engine, rank) distinctly, for fabrics that resolve names
/// (the loopback fabric and the tests). The NIXL fabric wants the `ip:port`
/// of the rank's handshake listener: use [`PortPerRankAddress`] there.
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultPeerAddress;

impl PeerAddress for DefaultPeerAddress {
    fn write_address(
        &self,
        engine: &EngineKey<'_>,
        rank: u32,
        out: &mut dyn fmt::Write,
    ) -> fmt::Result {
        write!(
            out,
            "{}:{}/{}/{}",
            engine.host, engine.port, engine.engine_id, rank
        )
    }
}

/// `{host}:{port + rank}`, e.g. `10.0.0.7:5603` for rank 3 of an engine whose
/// `remote_port` is 5600: one handshake listener per P rank on consecutive
/// ports, the `ip:port` form the NIXL fabric takes (`fabric::nixl::NixlFabric`,
/// feature `nixl`; not a link, so that the docs build without it). An
/// engine that lays out its listeners otherwise supplies its own
/// [`PeerAddress`].
#[derive(Clone, Copy, Debug, Default)]
pub struct PortPerRankAddress;

impl PeerAddress for PortPerRankAddress {
    fn write_address(
        &self,
        engine: &EngineKey<'_>,
        rank: u32,
        out: &mut dyn fmt::Write,
    ) -> fmt::Result {
        write!(out, "{}:{}", engine.host, u32::from(engine.port) + rank)
    }
}
