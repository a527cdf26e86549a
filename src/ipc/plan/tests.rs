use super::*;
use crate::config::{EngineShape, LeaseConfig};
use crate::consumer::{HeartbeatTracker, RemotePrefillParams};
use crate::time::Instant;

fn tracker() -> HeartbeatTracker {
    let mut c = LeaseConfig::new(EngineShape {
        num_kv_blocks: 64,
        max_num_seqs: 8,
    });
    c.max_tracked_requests = 16;
    c.max_remote_engines = 4;
    c.validate().unwrap();
    let mut t = HeartbeatTracker::new(&c, 1).expect("tracker");
    for (d, e, p, lease) in [
        ("d1", "engA", "p1", Some((7, 0xA1))),
        ("d2", "engA", "p2", Some((8, 0xA2))),
        ("d3", "engB", "p3", None),
        ("d4", "engB", "p4", Some((9, 0xB4))),
    ] {
        let params = RemotePrefillParams {
            do_remote_prefill: true,
            remote_engine_id: Some(e),
            remote_request_id: Some(p),
            remote_host: Some("10.0.0.1"),
            remote_port: Some(5600),
            tp_size: Some(2),
            pp_size: Some(3),
            remote_lease_slot: lease.map(|l| l.0),
            remote_lease_nonce: lease.map(|l| l.1 as i64),
            ..Default::default()
        };
        t.on_new_request(d, &params, Instant::ZERO).unwrap();
    }
    t
}

/// Engines A (both leased), B (one not), and a gone notice.
fn sample() -> Vec<u8> {
    let mut t = tracker();
    // A worker owes a heartbeat to an engine that has since gone.
    t.request_engines([EngineHandle {
        index: 3,
        generation: 9,
    }]);
    let mut buf = vec![0u8; t.plan_len(Instant::ZERO)];
    let n = t.encode_plan(Instant::ZERO, &mut buf).unwrap();
    assert_eq!(n, buf.len());
    buf
}

const A: usize = 32; // section A
const B: usize = 32 + 3 * 44; // section B: after two engines and one gone notice

fn engine_at(i: usize, field: usize) -> usize {
    A + i * 44 + field
}

fn member_at(j: usize, field: usize) -> usize {
    B + j * 24 + field
}

#[test]
fn round_trip() {
    let bytes = sample();
    let plan = HeartbeatPlan::decode(&bytes).unwrap();
    assert_eq!((plan.seq(), plan.len(), plan.members()), (0, 2, 4));
    assert_eq!(
        plan.gone().collect::<Vec<_>>(),
        [EngineHandle {
            index: 3,
            generation: 9
        }]
    );
    let mut seen = Vec::new();
    for e in plan.engines() {
        let k = e.key();
        assert_eq!((k.host, k.port, k.tp_size), ("10.0.0.1", 5600, 2));
        assert_eq!(
            (e.pp_size(), e.dcp_size(), e.reason()),
            (3, 1, BatchReason::Due)
        );
        let members: Vec<(String, Option<(u32, u64)>)> = e
            .remotes()
            .map(|r| {
                (
                    r.remote_request_id.to_string(),
                    r.lease.map(|l| (l.slot, l.nonce.get())),
                )
            })
            .collect();
        assert_eq!(e.all_leased(), members.iter().all(|m| m.1.is_some()));
        assert_eq!(
            e.leases().count(),
            members.iter().filter(|m| m.1.is_some()).count()
        );
        seen.push((k.engine_id.to_string(), members));
    }
    seen.sort();
    assert_eq!(
        seen,
        [
            (
                "engA".to_string(),
                vec![
                    ("p1".to_string(), Some((7, 0xA1))),
                    ("p2".to_string(), Some((8, 0xA2)))
                ]
            ),
            (
                "engB".to_string(),
                vec![
                    ("p3".to_string(), None),
                    ("p4".to_string(), Some((9, 0xB4)))
                ]
            ),
        ]
    );
    // Re-encoding the decoded plan gives the very same bytes.
    let mut again = vec![0u8; encoded_len(plan.engines(), plan.gone())];
    let n = encode(&mut again, plan.seq(), plan.engines(), plan.gone()).unwrap();
    assert_eq!(&again[..n], &bytes[..]);
}

#[test]
fn an_empty_plan_is_a_bare_header() {
    let mut t = tracker();
    let mut buf = [0u8; 4096];
    t.encode_plan(Instant::ZERO, &mut buf).unwrap();
    // Nothing is due one step later (and nothing owed or gone).
    assert_eq!(t.plan_len(Instant::from_millis(10)), 32);
    let n = t.encode_plan(Instant::from_millis(10), &mut buf).unwrap();
    let plan = HeartbeatPlan::decode(&buf[..n]).unwrap();
    assert!(plan.is_empty());
    assert_eq!((plan.seq(), plan.gone().len()), (1, 0));
}

#[test]
fn bad_records_are_refused_by_index() {
    let bytes = sample();
    let plan = HeartbeatPlan::decode(&bytes).unwrap();
    // Which engine record is B (the one with an unleased member)?
    let b = plan.engines().position(|e| !e.all_leased()).unwrap();
    let a = 1 - b;
    let (a_member, b_member) = if a == 0 { (0, 2) } else { (2, 0) };
    let le32 = |v: u32| v.to_le_bytes().to_vec();
    let le16 = |v: u16| v.to_le_bytes().to_vec();
    let cases: Vec<(usize, Vec<u8>, u32, &str)> = vec![
        (engine_at(0, 42), vec![9], 0, "unknown engine record kind"),
        (engine_at(1, 8), le32(0), 1, "tp_size 0"),
        (engine_at(0, 36), le16(0), 0, "empty engine id"),
        (engine_at(0, 38), le16(0), 0, "empty host"),
        (engine_at(0, 43), vec![3], 0, "unknown flag bits"),
        (
            engine_at(b, 43),
            vec![FLAG_ALL_LEASED],
            b as u32,
            "all-leased flag disagrees with the members",
        ),
        (
            engine_at(1, 20),
            le32(1),
            1,
            "member range not right after the previous engine's",
        ),
        (
            engine_at(0, 24),
            le32(0),
            0,
            "member range empty or outside section B",
        ),
        (
            engine_at(1, 24),
            le32(3),
            1,
            "member range empty or outside section B",
        ),
        (
            member_at(a_member, 18),
            vec![1],
            a_member as u32,
            "member reserved bytes not 0",
        ),
        (
            member_at(a_member + 1, 12),
            le32(0),
            (a_member + 1) as u32,
            "member id out of order, outside the id area or not UTF-8",
        ),
        (
            engine_at(0, 28),
            le32(1),
            0,
            "id not where the previous one ended",
        ),
        (
            engine_at(2, 8),
            le32(1),
            2,
            "gone notice with fields other than its handle",
        ),
    ];
    for (at, patch, index, what) in cases {
        let mut bad = bytes.clone();
        bad[at..at + patch.len()].copy_from_slice(&patch);
        assert_eq!(
            HeartbeatPlan::decode(&bad).map(|_| ()),
            Err(IpcError::BadRecord { index, what }),
            "{what}"
        );
    }
    // The unleased member of B with a slot but no nonce.
    let unleased = (b_member..b_member + 2)
        .find(|&j| {
            let off = member_at(j, 0);
            bytes[off..off + 8] == [0; 8]
        })
        .unwrap();
    let mut bad = bytes.clone();
    bad[member_at(unleased, 8)..member_at(unleased, 12)].copy_from_slice(&le32(5));
    assert_eq!(
        HeartbeatPlan::decode(&bad).map(|_| ()),
        Err(IpcError::BadRecord {
            index: unleased as u32,
            what: "member slot without a nonce"
        })
    );
    // The last id byte (a member id) becomes ',' then not UTF-8.
    let last = bytes.len() - 1;
    for (byte, what) in [
        (b',', "member id empty or with ','"),
        (
            0xFF,
            "member id out of order, outside the id area or not UTF-8",
        ),
    ] {
        let mut bad = bytes.clone();
        bad[last] = byte;
        match HeartbeatPlan::decode(&bad) {
            Err(IpcError::BadRecord { what: w, .. }) => assert_eq!(w, what),
            other => panic!("{what}: {other:?}"),
        }
    }
    // An engine record after a gone notice: swap the last two records.
    let mut bad = bytes.clone();
    let (e1, g) = (engine_at(1, 0), engine_at(2, 0));
    let rec1 = bytes[e1..e1 + 44].to_vec();
    bad.copy_within(g..g + 44, e1);
    bad[g..g + 44].copy_from_slice(&rec1);
    assert_eq!(
        HeartbeatPlan::decode(&bad).map(|_| ()),
        Err(IpcError::BadRecord {
            index: 2,
            what: "engine record after a gone notice"
        })
    );
    // A member no engine covers: the last engine claims one fewer.
    let mut bad = bytes.clone();
    bad[engine_at(1, 24)..engine_at(1, 28)].copy_from_slice(&le32(1));
    let flag_fix = plan.engines().nth(1).unwrap();
    if !flag_fix.all_leased() {
        // Its first member may be the unleased one: keep the flag true
        // to the member it still covers.
        let first = member_at(2, 0);
        let leased = bytes[first..first + 8] != [0; 8];
        bad[engine_at(1, 43)] = u8::from(leased);
    }
    assert_eq!(
        HeartbeatPlan::decode(&bad).map(|_| ()),
        Err(IpcError::BadRecord {
            index: 3,
            what: "member record of no engine"
        })
    );
    // Sent by a worker, not the scheduler.
    let mut bad = bytes.clone();
    bad[8..12].copy_from_slice(&le32(0));
    assert_eq!(
        HeartbeatPlan::decode(&bad).map(|_| ()),
        Err(IpcError::WrongSender {
            expected: FROM_SCHEDULER,
            found: 0
        })
    );
    // A stray byte at the end of the id area.
    let mut bad = bytes.clone();
    bad.push(b'x');
    let ids_len = u32::from_le_bytes(bad[24..28].try_into().unwrap()) + 1;
    bad[24..28].copy_from_slice(&le32(ids_len));
    assert_eq!(
        HeartbeatPlan::decode(&bad).map(|_| ()),
        Err(IpcError::BadRecord {
            index: 3,
            what: "id area bytes no record refers to"
        })
    );
}

#[test]
fn too_small_a_buffer_changes_nothing() {
    let mut t = tracker();
    let mut buf = vec![0u8; 4096];
    t.encode_plan(Instant::ZERO, &mut buf).unwrap();
    // One engine owed, one gone notice pending, nothing due.
    let owed = t.engines().next().unwrap().handle();
    t.request_engines([
        owed,
        EngineHandle {
            index: 3,
            generation: 1,
        },
    ]);
    let now = Instant::from_millis(10);
    let need = t.plan_len(now);
    let before = t.counters();
    let mut small = vec![0u8; need - 1];
    assert_eq!(
        t.encode_plan(now, &mut small),
        Err(IpcError::BufferTooSmall { needed: need })
    );
    assert_eq!(t.counters(), before, "nothing consumed or counted");
    // The same plan, with room: the owed engine and the notice are there.
    let mut big = vec![0u8; need];
    assert_eq!(t.encode_plan(now, &mut big), Ok(need));
    let plan = HeartbeatPlan::decode(&big).unwrap();
    assert_eq!(plan.seq(), 1);
    let e = plan.engines().next().unwrap();
    assert_eq!(
        (plan.len(), e.handle(), e.reason()),
        (1, owed, BatchReason::Owed)
    );
    assert_eq!(plan.gone().len(), 1);
    assert_eq!(t.plan_len(now), 32, "both consumed once encoded");
}
