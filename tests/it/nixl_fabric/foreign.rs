//! Embedders whose peers do not speak kvlease, over real NIXL: an engine
//! that owns its agent drains notifications that are not UTF-8
//! (`drain_raw_notifications`); D registers a foreign P's KV regions with
//! `add_peer` and pulls the KV with `Fabric::post_read`; a kvlease fabric's
//! metadata and regions (`local_metadata`, `local_region`) let an agent
//! that knows nothing of kvlease's side channel READ from it.

use std::sync::Arc;

use crate::support::nixl_gate::nixl_or_skip;
use crate::support::nixl_pair::{desc, engine_agent, fabric, poll_until, register_words, WAIT};
use kvlease::fabric::nixl::{drain_raw_notifications, nixl_sys, NixlFabric, ProgressMode};
use kvlease::fabric::{
    Fabric, FabricError, HandshakeState, PeerRecord, RegionId, RemoteRegion, XferState,
};
use kvlease::{LeaseSlots, MonotonicClock};
use nixl_sys::{
    MemType, NixlRegistration, NotificationMap, OptArgs, SystemStorage, XferDescList, XferOp,
    XferStatus,
};

const KV_LEN: usize = 4096;

/// Registers `agent` with a kvlease fabric by its metadata alone (no
/// advert: a peer that does not speak kvlease).
fn register_foreign(
    f: &mut NixlFabric,
    agent: &nixl_sys::Agent,
    regions: &[RemoteRegion],
    clock: MonotonicClock,
) -> Result<kvlease::fabric::AgentId, FabricError> {
    let name = agent.name();
    let metadata = agent.get_local_md().expect("metadata");
    f.add_peer(
        &PeerRecord {
            agent_name: &name,
            metadata: &metadata,
            advert: None,
            clock: None,
            regions,
        },
        clock.now(),
    )
}

/// The bytes of a registered storage that a READ wrote.
fn bytes_of(s: &SystemStorage) -> Vec<u8> {
    let p = s.as_slice().as_ptr();
    // SAFETY: in bounds of the storage; the READ that wrote it finished.
    (0..s.as_slice().len())
        .map(|i| unsafe { std::ptr::read_volatile(p.add(i)) })
        .collect()
}

#[test]
fn raw_drain_hands_an_engine_notifications_that_are_not_utf8() {
    let Some(_g) = nixl_or_skip() else { return };
    let clock = MonotonicClock::new();
    let engine = engine_agent("engine");
    let mut sender = fabric("sender", clock, ProgressMode::EngineLoop);
    let to_engine = register_foreign(&mut sender, &engine, &[], clock).unwrap();
    let binary = [0xff, 0x00, 0xfe, b'x'];
    sender.send_notification(to_engine, &binary).unwrap();
    sender.send_notification(to_engine, b"HB:req-1").unwrap();

    // What an engine draining with nixl-sys alone sees: take_notifs fails,
    // and the messages stay in the map.
    let mut map = NotificationMap::new().unwrap();
    poll_until(WAIT, || {
        sender.drain_notifications(&mut |_, _| {}).unwrap();
        engine.get_notifications(&mut map, None).unwrap();
        (map.get_notifications_size(sender.name()).unwrap_or(0) >= 2).then_some(())
    })
    .expect("both notifications arrive");
    assert!(map.take_notifs().is_err());
    assert!(!map.is_empty().unwrap(), "take_notifs left them queued");

    // The raw drain hands both out, as bytes, with the sender's name.
    let mut got = Vec::new();
    let r = drain_raw_notifications(&engine, &mut map, &mut |from, m| {
        got.push((from.to_owned(), m.to_vec()))
    })
    .unwrap();
    assert_eq!(
        got,
        [
            (sender.name().to_owned(), binary.to_vec()),
            (sender.name().to_owned(), b"HB:req-1".to_vec())
        ]
    );
    assert_eq!(
        (r.delivered, r.map_replaced, r.senders_skipped),
        (2, true, 0)
    );
    assert!(map.is_empty().unwrap());

    // The map it left is usable: text goes the cheap way, nothing twice.
    sender.send_notification(to_engine, b"after").unwrap();
    got.clear();
    poll_until(WAIT, || {
        sender.drain_notifications(&mut |_, _| {}).unwrap();
        let r = drain_raw_notifications(&engine, &mut map, &mut |from, m| {
            got.push((from.to_owned(), m.to_vec()))
        })
        .unwrap();
        assert!(!r.map_replaced);
        (!got.is_empty()).then_some(())
    })
    .expect("the next notification");
    assert_eq!(got, [(sender.name().to_owned(), b"after".to_vec())]);
    let r = drain_raw_notifications(&engine, &mut map, &mut |_, _| panic!("delivered twice"));
    assert_eq!(r.unwrap().delivered, 0);
}

#[test]
fn add_peer_registers_a_foreign_ps_kv_for_post_read() {
    let Some(_g) = nixl_or_skip() else { return };
    let clock = MonotonicClock::new();
    // A P engine that knows nothing of kvlease: its own agent, its own KV.
    let p_engine = engine_agent("foreign-p");
    let mut kv = SystemStorage::new(KV_LEN).unwrap();
    kv.memset(0xAB);
    kv.register(&p_engine, None).unwrap();
    let kv_region = RemoteRegion {
        addr: kv.as_slice().as_ptr() as u64,
        len: KV_LEN as u64,
    };
    let mut p_map = NotificationMap::new().unwrap();

    let mut landing = vec![0u64; KV_LEN / 8];
    let mut d = fabric("d", clock, ProgressMode::EngineLoop);
    let d_land = register_words(&mut d, &mut landing);
    // Typed refusals of a region list that cannot be right.
    for bad in [
        RemoteRegion { addr: 4096, len: 0 },
        RemoteRegion {
            addr: u64::MAX,
            len: 8,
        },
    ] {
        assert_eq!(
            register_foreign(&mut d, &p_engine, &[bad], clock),
            Err(FabricError::UnknownRegion)
        );
    }
    let id = register_foreign(&mut d, &p_engine, &[kv_region], clock).unwrap();
    let HandshakeState::Ready(info) = d.handshake_state(id, clock.now()) else {
        panic!("a registered peer is ready");
    };
    assert_eq!((info.slot_region, info.slot_count), (None, 0));

    // The KV pull, with the read-done notification vLLM attaches.
    let all = desc(d_land, 0, RegionId(0), 0, KV_LEN as u64);
    let x = d
        .post_read(id, &[all], Some(b"req-9:1"), clock.now())
        .unwrap();
    let mut heard = Vec::new();
    let state = poll_until(WAIT, || {
        drain_raw_notifications(&p_engine, &mut p_map, &mut |_, m| heard.push(m.to_vec())).unwrap();
        match d.read_state(x, clock.now()) {
            XferState::InProgress => None,
            s => Some(s),
        }
    });
    assert_eq!(state, Some(XferState::Done));
    for (i, w) in landing.iter().enumerate() {
        // SAFETY: in bounds; the READ finished.
        assert_eq!(
            unsafe { std::ptr::read_volatile(w) },
            0xABAB_ABAB_ABAB_ABAB,
            "word {i}"
        );
    }
    poll_until(WAIT, || {
        d.drain_notifications(&mut |_, _| {}).unwrap();
        drain_raw_notifications(&p_engine, &mut p_map, &mut |_, m| heard.push(m.to_vec())).unwrap();
        (!heard.is_empty()).then_some(())
    })
    .expect("the read-done notification");
    assert_eq!(heard, [b"req-9:1".to_vec()]);
    // Only what the record listed is readable.
    assert_eq!(
        d.post_read(id, &[desc(d_land, 0, RegionId(1), 0, 8)], None, clock.now()),
        Err(FabricError::UnknownRegion)
    );
    assert_eq!(
        d.post_read(
            id,
            &[desc(d_land, 0, RegionId(0), KV_LEN as u64 - 4, 8)],
            None,
            clock.now()
        ),
        Err(FabricError::OutOfBounds)
    );
}

#[test]
fn a_kvlease_p_is_reachable_by_its_metadata_alone() {
    let Some(_g) = nixl_or_skip() else { return };
    let clock = MonotonicClock::new();
    // P: kvlease's fabric over its own agent, lease slots and KV words.
    let slots = Arc::new(LeaseSlots::new(16));
    let mut kv: Vec<u64> = (0..64).map(|i| 0x1000 + i).collect();
    let mut p = fabric("p", clock, ProgressMode::EngineLoop);
    let slot_region = p.register_slots(slots.clone(), true).unwrap();
    let kv_id = register_words(&mut p, &mut kv);
    let metadata = p.local_metadata().unwrap();
    let kv_region = p.local_region(kv_id).unwrap();
    assert_eq!(kv_region.len, 64 * 8);
    assert_eq!(p.local_region(RegionId(9)), None);
    assert_eq!(
        p.local_region(slot_region).map(|r| r.addr),
        p.lease_advert().slots.map(|s| s.addr)
    );

    // An engine agent that never heard of kvlease's side channel loads the
    // metadata and READs P's KV with its own request.
    let engine = engine_agent("reader");
    assert_eq!(engine.load_remote_md(&metadata).unwrap(), p.name());
    let mut landing = SystemStorage::new(64 * 8).unwrap();
    landing.register(&engine, None).unwrap();
    let mut local = XferDescList::new(MemType::Dram).unwrap();
    let mut remote = XferDescList::new(MemType::Dram).unwrap();
    local.add_desc(landing.as_slice().as_ptr() as usize, 64 * 8, 0);
    remote.add_desc(kv_region.addr as usize, kv_region.len as usize, 0);
    let req = engine
        .create_xfer_req(XferOp::Read, &local, &remote, p.name(), None)
        .unwrap();
    let mut opt = OptArgs::new().unwrap();
    opt.set_has_notification(false).unwrap();
    let in_progress = engine.post_xfer_req(&req, Some(&opt)).unwrap();
    if in_progress {
        poll_until(WAIT, || {
            p.drain_notifications(&mut |_, _| {}).unwrap();
            match engine.get_xfer_status(&req).unwrap() {
                XferStatus::Success => Some(()),
                XferStatus::InProgress => None,
            }
        })
        .expect("the engine's READ of P's KV");
    }
    let got = bytes_of(&landing);
    let want: Vec<u8> = kv.iter().flat_map(|w| w.to_le_bytes()).collect();
    assert_eq!(got, want);

    // And a kvlease D registers P the same way, slots and KV together: the
    // KV is region 0 as listed, the slots come after it.
    let mut dst = vec![0u64; 65];
    let mut d = fabric("d", clock, ProgressMode::EngineLoop);
    let d_dst = register_words(&mut d, &mut dst);
    let id = d
        .add_peer(
            &PeerRecord {
                agent_name: p.name(),
                metadata: &metadata,
                advert: Some(p.lease_advert()),
                clock: None,
                regions: &[kv_region],
            },
            clock.now(),
        )
        .unwrap();
    let HandshakeState::Ready(info) = d.handshake_state(id, clock.now()) else {
        panic!("a registered peer is ready");
    };
    assert_eq!((info.slot_region, info.slot_count), (Some(RegionId(1)), 16));
    let x = d
        .post_read(
            id,
            &[
                desc(d_dst, 0, RegionId(0), 0, 64 * 8),
                desc(d_dst, 64 * 8, RegionId(1), LeaseSlots::offset_of(3), 8),
            ],
            None,
            clock.now(),
        )
        .unwrap();
    let state = poll_until(WAIT, || {
        p.drain_notifications(&mut |_, _| {}).unwrap();
        match d.read_state(x, clock.now()) {
            XferState::InProgress => None,
            s => Some(s),
        }
    });
    assert_eq!(state, Some(XferState::Done));
    // SAFETY: in bounds; the READ finished. Words 0..64 are the KV, word
    // 64 is slot 3 (0: never granted).
    let word = |i: usize| unsafe { std::ptr::read_volatile(&dst[i]) };
    for (i, w) in kv.iter().enumerate() {
        assert_eq!(word(i), *w, "word {i}");
    }
    assert_eq!(word(64), slots.load(3).unwrap());
    drop(d);
    drop(p);
}
