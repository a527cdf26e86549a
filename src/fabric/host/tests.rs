use super::*;
use crate::consumer::{LeaseVerifier, Verdict, VerifyTarget};
use crate::fabric::{LeaseAdvert, SlotRegion};
use crate::lease_fields::LeaseFields;
use crate::slots::LeaseSlots;

const T0: Instant = Instant::from_secs(1);

/// P rank `name` exporting `slots`, as the host's own handshake saw it.
fn add(f: &mut HostFabric, name: &str, slots: &LeaseSlots) -> AgentId {
    let advert = LeaseAdvert {
        slots: Some(SlotRegion {
            addr: slots.as_ptr() as u64,
            len: slots.byte_len() as u64,
            count: slots.len(),
        }),
        compact_heartbeats: false,
        packed_heartbeats: false,
    };
    f.add_peer(
        &PeerRecord {
            agent_name: name,
            metadata: &[],
            advert: Some(advert),
            clock: None,
            regions: &[],
        },
        T0,
    )
    .unwrap()
}

/// The host's side of a step: every posted READ performed against the
/// remote slot arrays (by name), then reported.
fn perform(
    f: &mut HostFabric,
    remotes: &[(&str, &LeaseSlots)],
    fail: Option<FabricError>,
) -> usize {
    let mut posted = Vec::new();
    f.take_posted(|r| posted.push((r.xfer, r.agent, r.descs.to_vec())));
    for (xfer, agent, descs) in &posted {
        let name = f.peer_name(*agent).unwrap().to_string();
        let (_, remote) = remotes.iter().find(|(n, _)| *n == name).unwrap();
        for d in descs {
            let (addr, len) = f.local_region(d.local).unwrap();
            assert!(d.local_offset + d.len <= len as u64);
            assert!(d.remote_offset + d.len <= remote.byte_len() as u64);
            // SAFETY: what NIXL does for the host: copy `len` bytes of the
            // remote's registered slot array into the registered landing
            // region, both in bounds (asserted above), single-threaded.
            unsafe {
                core::ptr::copy_nonoverlapping(
                    remote.as_ptr().add(d.remote_offset as usize),
                    (addr as *mut u8).add(d.local_offset as usize),
                    d.len as usize,
                );
            }
        }
        f.complete(*xfer, fail.map_or(Ok(()), Err));
    }
    posted.len()
}

fn verifier(f: &mut HostFabric) -> LeaseVerifier {
    LeaseVerifier::new(f, &crate::testkit::verifier_config(8, 4)).unwrap()
}

fn run(v: &mut LeaseVerifier, f: &mut HostFabric) -> Vec<(u64, Verdict)> {
    let mut out = Vec::new();
    v.step(f, T0, |t, verdict| out.push((t, verdict)));
    out.sort_by_key(|x| x.0);
    out
}

#[test]
fn the_host_reads_and_the_verifier_compares_the_landed_words() {
    let (p0, p1) = (LeaseSlots::new(64), LeaseSlots::new(64));
    p0.publish(5, 0x55);
    p1.publish(5, 0x55);
    p0.publish(9, 0x99);
    let mut f = HostFabric::new("decode-0", HostConfig::for_verifier(8, 4, 16));
    let (a0, a1) = (add(&mut f, "p0", &p0), add(&mut f, "p1", &p1));
    let mut v = verifier(&mut f);
    assert!(
        f.local_regions().count() >= 2,
        "landing cells and windows to register"
    );
    let t = |a, s: &LeaseSlots| VerifyTarget::new(a, RegionId(0), s.len());
    v.submit(
        1,
        LeaseFields::from_params(Some(5), Some(0x55)),
        &[t(a0, &p0), t(a1, &p1)],
    )
    .unwrap();
    // p1's slot 9 was never written: this check lapses.
    v.submit(
        2,
        LeaseFields::from_params(Some(9), Some(0x99)),
        &[t(a0, &p0), t(a1, &p1)],
    )
    .unwrap();
    assert!(run(&mut v, &mut f).is_empty(), "READs posted, none done");
    let remotes = [("p0", &p0), ("p1", &p1)];
    assert_eq!(perform(&mut f, &remotes, None), 2, "one READ per P rank");
    assert_eq!(
        run(&mut v, &mut f),
        [(1, Verdict::Verified), (2, Verdict::Lapsed)]
    );
    assert_eq!(f.reads_in_flight(), 0);
}

#[test]
fn a_read_the_host_failed_fails_the_check() {
    let p0 = LeaseSlots::new(8);
    p0.publish(1, 7);
    let mut f = HostFabric::new("d", HostConfig::for_verifier(8, 4, 16));
    let a = add(&mut f, "p0", &p0);
    let mut v = verifier(&mut f);
    v.submit(
        1,
        LeaseFields::from_params(Some(1), Some(7)),
        &[VerifyTarget::new(a, RegionId(0), 8)],
    )
    .unwrap();
    run(&mut v, &mut f);
    perform(&mut f, &[("p0", &p0)], Some(FabricError::TimedOut));
    assert_eq!(
        run(&mut v, &mut f),
        [(1, Verdict::ReadFailed(FabricError::TimedOut))]
    );
}

#[test]
fn a_removed_peer_fails_its_reads_and_its_id_stays_unknown() {
    let p0 = LeaseSlots::new(8);
    let mut f = HostFabric::new("d", HostConfig::for_verifier(8, 4, 16));
    let a = add(&mut f, "p0", &p0);
    let mut v = verifier(&mut f);
    v.submit(
        1,
        LeaseFields::from_params(Some(1), Some(7)),
        &[VerifyTarget::new(a, RegionId(0), 8)],
    )
    .unwrap();
    run(&mut v, &mut f);
    f.remove_peer(a).unwrap();
    assert_eq!(
        run(&mut v, &mut f),
        [(1, Verdict::ReadFailed(FabricError::Cancelled))]
    );
    let b = add(&mut f, "p0-restarted", &p0);
    assert_ne!(a, b);
    assert!(f.peer_name(a).is_none());
    assert!(matches!(
        f.handshake_state(a, T0),
        HandshakeState::Failed(FabricError::UnknownAgent)
    ));
    // The same name again is a restart: a new id.
    let c = add(&mut f, "p0-restarted", &p0);
    assert_ne!(b, c);
    assert_eq!(f.peer_name(c), Some("p0-restarted"));
}

#[test]
fn capacities_are_typed_errors_never_panics() {
    let p0 = LeaseSlots::new(8);
    let mut f = HostFabric::new(
        "d",
        HostConfig {
            max_peers: 1,
            max_reads: 1,
            max_descs: 1,
        },
    );
    let a = add(&mut f, "p0", &p0);
    let advert_less = PeerRecord {
        agent_name: "p1",
        metadata: &[],
        advert: None,
        clock: None,
        regions: &[],
    };
    assert_eq!(f.add_peer(&advert_less, T0), Err(FabricError::Full));
    let words = LandingWords::new(4);
    let local = f.register_landing(words).unwrap();
    let desc = ReadDesc {
        local,
        local_offset: 0,
        remote: RegionId(0),
        remote_offset: 0,
        len: 8,
    };
    let x = f.post_read(a, &[desc], None, T0).unwrap();
    assert_eq!(f.post_read(a, &[desc], None, T0), Err(FabricError::Full));
    assert_eq!(
        f.post_read(a, &[ReadDesc { len: 64, ..desc }], None, T0),
        Err(FabricError::OutOfBounds)
    );
    assert_eq!(
        f.post_read(AgentId(77), &[desc], None, T0),
        Err(FabricError::UnknownAgent)
    );
    assert_eq!(
        f.post_read(a, &[desc], Some(b"x:1"), T0),
        Err(FabricError::Unsupported)
    );
    assert_eq!(f.read_state(x, T0), XferState::InProgress);
    assert!(!f.complete(x, Ok(())), "not taken yet: nothing to complete");
    f.take_posted(|_| {});
    assert!(f.complete(x, Ok(())));
    assert!(!f.complete(x, Ok(())), "twice is a no-op");
    assert_eq!(f.read_state(x, T0), XferState::Done);
    assert_eq!(
        f.read_state(x, T0),
        XferState::Failed(FabricError::UnknownXfer),
        "reported once"
    );
    assert_eq!(
        f.send_notification(a, b"HB:x"),
        Err(FabricError::Unsupported)
    );
}
