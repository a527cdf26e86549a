//! The notification codec (`kvlease::wire`) and the lease advert, for the
//! bytes Python sends and drains with its own `nixl_agent`.

use kvlease::fabric::{LeaseAdvert, SlotRegion};
use kvlease::wire::{self, CompactEntry, Notification, ReadDoneForm, WireError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};
use pyo3::IntoPyObjectExt;

use crate::convert::{nonce, with_bytes};
use crate::errors;

/// `"with_nonce"` for a peer that advertises lease slots, `"plain"` (vLLM's
/// `id:consumers`) for one that does not: a stock vLLM P would take the
/// nonce form for an unknown id and hold the blocks until the lease
/// expires.
#[pyfunction]
pub(crate) fn read_done_form(peer_has_lease_slots: bool) -> &'static str {
    match ReadDoneForm::for_peer(peer_has_lease_slots) {
        ReadDoneForm::Plain => "plain",
        ReadDoneForm::WithNonce => "with_nonce",
    }
}

/// The read-done for a peer: `id:consumers`, plus `:nonce=<16 hex>` only
/// when the peer advertises lease slots and the request has a nonce
/// (int64). Raises `WireError` for an empty id, 0 consumers, or an id that
/// would read as a heartbeat.
#[pyfunction]
#[pyo3(signature = (request_id, consumers, nonce_value, peer_has_lease_slots))]
pub(crate) fn encode_read_done<'py>(
    py: Python<'py>,
    request_id: &str,
    consumers: u32,
    nonce_value: Option<i64>,
    peer_has_lease_slots: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    let form = ReadDoneForm::for_peer(peer_has_lease_slots);
    let n = nonce_value.and_then(nonce);
    let sent = match form {
        ReadDoneForm::WithNonce => n,
        ReadDoneForm::Plain => None,
    };
    let len = wire::read_done_len(request_id, consumers, sent);
    PyBytes::new_with(py, len, |buf| {
        wire::encode_read_done_for(form, request_id, consumers, n, buf).map_err(errors::wire)?;
        Ok(())
    })
}

/// `HB:` heartbeats renewing `ids`, split so that none exceeds `max_len`
/// bytes (vLLM's P accepts every piece). Raises `WireError` for an id that
/// a heartbeat cannot carry (empty, or containing `,`).
#[pyfunction]
#[pyo3(signature = (ids, max_len = 65536))]
pub(crate) fn encode_heartbeats<'py>(
    py: Python<'py>,
    ids: Vec<String>,
    max_len: usize,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    for id in &ids {
        wire::check_heartbeat_id(id).map_err(errors::wire)?;
    }
    let mut scratch = vec![0u8; max_len.max(4)];
    let mut out = Vec::new();
    wire::encode_heartbeats(ids.iter().map(String::as_str), max_len, &mut scratch, |m| {
        out.push(PyBytes::new(py, m))
    })
    .map_err(errors::wire)?;
    Ok(out)
}

/// `HBC:` compact heartbeats renewing `entries`, each `(slot, nonce)` as P
/// exported them (`remote_lease_slot`, `remote_lease_nonce` in its int64
/// form), split so that none exceeds `max_len` bytes; with `packed`, the
/// same records as `HBP:` packed heartbeats (16 bytes a record instead of
/// 24, and about four times cheaper for P to decode). Only for a peer that
/// advertises the form (`advert_accepts_compact_heartbeats`,
/// `advert_accepts_packed_heartbeats`): a stock vLLM P would take the
/// message for a read-done of an unknown id.
/// Raises `WireError` for a nonce of 0 (no lease has it) or a `max_len`
/// under one record and the prefix (28 bytes, packed 20), before anything
/// is encoded; a slot outside u32 or a nonce outside int64 is refused by
/// the conversion itself (`OverflowError`).
#[pyfunction]
#[pyo3(signature = (entries, max_len = 65536, packed = false))]
pub(crate) fn encode_compact_heartbeats<'py>(
    py: Python<'py>,
    entries: &Bound<'py, PyAny>,
    max_len: usize,
    packed: bool,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    // Collected first, so that a bad entry raises before any message exists.
    let mut records = Vec::with_capacity(entries.len().unwrap_or(0));
    for item in entries.try_iter()? {
        let (slot, nonce_value): (u32, i64) = item?.extract()?;
        let nonce = nonce(nonce_value).ok_or_else(|| errors::wire(WireError::ZeroNonce))?;
        records.push(CompactEntry { slot, nonce });
    }
    // No message is longer than all the records in one, so the scratch
    // buffer is sized to that, not to a `max_len` from outside (which could
    // ask for any amount of memory); a `max_len` too small for one record
    // stays too small and is refused by the encoder.
    let record_len = if packed {
        wire::PACKED_RECORD_LEN
    } else {
        wire::COMPACT_RECORD_LEN
    };
    // Both prefixes are 4 bytes.
    let whole =
        wire::COMPACT_HEARTBEAT_PREFIX.len() + record_len.saturating_mul(records.len().max(1));
    let max_len = max_len.min(whole);
    let mut scratch = vec![0u8; max_len];
    let mut out = Vec::new();
    let emit = |m: &[u8]| out.push(PyBytes::new(py, m));
    if packed {
        wire::encode_packed_heartbeats(records, max_len, &mut scratch, emit)
    } else {
        wire::encode_compact_heartbeats(records, max_len, &mut scratch, emit)
    }
    .map_err(errors::wire)?;
    Ok(out)
}

/// Decodes one notification: `("heartbeat", [ids])`, `("compact", [(slot,
/// nonce)])`, `("packed", [(slot, nonce)])` or `("read_done", id,
/// consumers, nonce_or_None)`. Raises `WireError` for bytes that are none
/// of them.
#[pyfunction]
pub(crate) fn decode_notification<'py>(
    py: Python<'py>,
    msg: &[u8],
) -> PyResult<Bound<'py, PyTuple>> {
    match wire::decode(msg).map_err(errors::wire)? {
        Notification::Heartbeat(ids) => {
            let ids: Vec<&str> = ids.collect();
            PyTuple::new(
                py,
                [
                    "heartbeat".into_bound_py_any(py)?,
                    ids.into_bound_py_any(py)?,
                ],
            )
        }
        Notification::CompactHeartbeat(entries) => records_tuple(py, "compact", entries),
        Notification::PackedHeartbeat(entries) => records_tuple(py, "packed", entries),
        Notification::ReadDone(rd) => PyTuple::new(
            py,
            [
                "read_done".into_bound_py_any(py)?,
                rd.request_id.into_bound_py_any(py)?,
                rd.consumers.into_bound_py_any(py)?,
                rd.nonce.map(|n| n.as_int64()).into_bound_py_any(py)?,
            ],
        ),
    }
}

/// The 32-byte lease advert a P worker puts in its handshake metadata: its
/// slot array at `address`, `nbytes` long, holding `count` slots; with
/// `compact_heartbeats`, the worker also says it renews on `HBC:` messages,
/// with `packed_heartbeats` on `HBP:` ones.
#[pyfunction]
#[pyo3(signature = (address, nbytes, count, compact_heartbeats = false, packed_heartbeats = false))]
pub(crate) fn lease_advert<'py>(
    py: Python<'py>,
    address: u64,
    nbytes: u64,
    count: u32,
    compact_heartbeats: bool,
    packed_heartbeats: bool,
) -> Bound<'py, PyBytes> {
    let advert = LeaseAdvert {
        slots: Some(SlotRegion {
            addr: address,
            len: nbytes,
            count,
        }),
        compact_heartbeats,
        packed_heartbeats,
    };
    PyBytes::new(py, &advert.encode())
}

/// A peer's lease advert: `(address, nbytes, count)` of its slot array, or
/// `None` when it advertises none. Raises `WireError` for bytes that are
/// not an advert.
#[pyfunction]
pub(crate) fn decode_lease_advert(advert: &Bound<'_, PyAny>) -> PyResult<Option<(u64, u64, u32)>> {
    with_bytes(advert, |advert| {
        let a = LeaseAdvert::decode(advert).map_err(errors::wire)?;
        Ok(a.slots.map(|s| (s.addr, s.len, s.count)))
    })
}

/// Whether a peer's lease advert says it renews on compact (`HBC:`)
/// heartbeats. Raises `WireError` for bytes that are not an advert.
#[pyfunction]
pub(crate) fn advert_accepts_compact_heartbeats(advert: &Bound<'_, PyAny>) -> PyResult<bool> {
    with_bytes(advert, |advert| {
        let a = LeaseAdvert::decode(advert).map_err(errors::wire)?;
        Ok(a.compact_heartbeats)
    })
}

/// Whether a peer's lease advert says it renews on packed (`HBP:`)
/// heartbeats. Raises `WireError` for bytes that are not an advert.
#[pyfunction]
pub(crate) fn advert_accepts_packed_heartbeats(advert: &Bound<'_, PyAny>) -> PyResult<bool> {
    with_bytes(advert, |advert| {
        let a = LeaseAdvert::decode(advert).map_err(errors::wire)?;
        Ok(a.packed_heartbeats)
    })
}

/// A decoded record heartbeat as `(kind, [(slot, nonce)])`.
fn records_tuple<'py>(
    py: Python<'py>,
    kind: &str,
    entries: impl Iterator<Item = CompactEntry>,
) -> PyResult<Bound<'py, PyTuple>> {
    let e: Vec<(u32, i64)> = entries.map(|e| (e.slot, e.nonce.as_int64())).collect();
    PyTuple::new(py, [kind.into_bound_py_any(py)?, e.into_bound_py_any(py)?])
}
