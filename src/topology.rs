//! Heterogeneous tensor parallelism, and P's pipeline stages: which P ranks
//! a D rank reads from, heartbeats and verifies.
//!
//! This module owns the rank arithmetic of vLLM's NixlConnector and nothing
//! else: it knows neither addresses nor agents (the heartbeat sender turns a
//! rank into a fabric address) nor requests. It allocates nothing; targets
//! come out as an iterator over a contiguous rank range.
//!
//! # The mapping (vLLM, notes/vllm.md)
//!
//! ```text
//! tp_ratio = local_tp / remote_tp        when local_tp >= remote_tp
//!          = -(remote_tp / local_tp)     otherwise
//!
//! targets(r) = [r / tp_ratio]                               tp_ratio > 0
//!            = [r*|tp_ratio| + i for i in 0..|tp_ratio|]    tp_ratio < 0
//! ```
//!
//! "local" is this D instance, "remote" the P instance. With P TP 4 and
//! D TP 2 the ratio is -2 and D rank 1 reads from (and heartbeats) P ranks 2
//! and 3: every P rank holds a lease for the request, so every one of them
//! must be renewed. With P TP 2 and D TP 4 the ratio is 2 and D ranks 2 and 3
//! both heartbeat P rank 1; the second heartbeat only refreshes the same
//! expiry again, which is harmless (the seed says so explicitly).
//!
//! # Read-done consumer counts: current vLLM, not the older world size
//!
//! A read-done is `<id>:<n>` ([`crate::wire`], form 2). We match **current
//! vLLM** (`nixl/pull_worker.py`): `n` is the number of D ranks that read
//! from the P rank receiving the notification, vLLM's `plan.local_consumers`,
//! which is [`TpMapping::consumers_per_p_rank`]: 1 when D TP <= P TP, D TP /
//! P TP otherwise. P counts read-dones per rank and releases a lease once
//! every one of its ranks has seen its `n` ([`crate::LeaseBook::read_done`]).
//!
//! Some older vLLM releases sent D's world size instead and let P derive the
//! per-rank count. A D of such a release talking to a kvlease P announces
//! more consumers than will ever report on a rank (D TP 2 toward P TP 4: 2
//! instead of 1), so the lease is never released by read-done: it expires
//! once D stops heartbeating, within one extension. Blocks are freed late,
//! never early. `tests/it/read_done_consumers.rs` checks both, over the wire.
//!
//! # Pipeline parallelism on P
//!
//! A P engine with PP > 1 has `tp × pp` workers, numbered as vLLM numbers
//! them: global rank = `stage * tp + tp_rank`. Each stage holds the layers
//! of its part of the model for *every* request, so every stage holds a
//! lease for the request, and a D rank that reads TP shard `t` reads it from
//! every stage. The targets of a D rank are therefore its TP targets
//! repeated on every stage:
//!
//! ```text
//! targets(r) = [stage * remote_tp + t  for stage in 0..remote_pp,  t in tp_targets(r)]
//! ```
//!
//! With P TP 2 × PP 2 and D TP 1, D rank 0 heartbeats and verifies P ranks
//! 0, 1, 2 and 3; with only `0..tp` (what ignoring PP gives) the leases of
//! stage 1 lapse under a busy D. The fan-out grows by the stage count, and
//! the read-done count per P rank does not change (a stage's rank is read by
//! the same D ranks as stage 0's).
//!
//! Decode-context parallelism (`dcp_size`) does not add ranks: DCP ranks
//! are TP ranks that split a request's tokens among themselves, so every
//! rank holding blocks is already a TP target of some D rank on every
//! stage. The tracker records `dcp_size` (and refuses 0, as it refuses a
//! `pp_size` of 0).
//!
//! vLLM uses integer division and silently mis-maps sizes that do not divide;
//! here a size that is zero or does not divide the other is a
//! [`TopologyError`], as is a rank outside `0..local_tp` and a fan-out
//! beyond `u32`.

use core::iter::FusedIterator;

/// Why a TP pair or a rank was refused.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    /// A TP size is 0.
    #[error("tensor-parallel size 0 (local tp {local_tp}, remote tp {remote_tp})")]
    ZeroTp {
        /// The local (D) TP size.
        local_tp: u32,
        /// The remote (P) TP size.
        remote_tp: u32,
    },
    /// The larger TP size is not a multiple of the smaller one, so ranks do
    /// not map onto whole groups.
    #[error("local tp {local_tp} and remote tp {remote_tp}: the larger is not a multiple of the smaller")]
    NotDivisible {
        /// The local (D) TP size.
        local_tp: u32,
        /// The remote (P) TP size.
        remote_tp: u32,
    },
    /// A local rank is not in `0..local_tp`.
    #[error("rank {rank} is outside 0..{local_tp}")]
    RankOutOfRange {
        /// The rank asked about.
        rank: u32,
        /// The local TP size.
        local_tp: u32,
    },
    /// P's pipeline-parallel size is 0, or `tp × pp` overflows a rank number.
    #[error("remote pipeline-parallel size {remote_pp} with remote tp {remote_tp}")]
    BadPp {
        /// The remote (P) TP size.
        remote_tp: u32,
        /// The remote (P) PP size.
        remote_pp: u32,
    },
}

/// A validated (local TP, remote TP, remote PP) triple and its vLLM
/// `tp_ratio`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TpMapping {
    local_tp: u32,
    remote_tp: u32,
    /// P's pipeline stages (1 unless [`TpMapping::with_remote_pp`]).
    remote_pp: u32,
    /// vLLM's `tp_ratio`; never 0. An `i64` because `-(u32::MAX)` must fit.
    ratio: i64,
}

impl TpMapping {
    /// Validates the pair: both non-zero, the larger a multiple of the smaller.
    pub const fn new(local_tp: u32, remote_tp: u32) -> Result<TpMapping, TopologyError> {
        if local_tp == 0 || remote_tp == 0 {
            return Err(TopologyError::ZeroTp {
                local_tp,
                remote_tp,
            });
        }
        let ratio = if local_tp >= remote_tp {
            if local_tp % remote_tp != 0 {
                return Err(TopologyError::NotDivisible {
                    local_tp,
                    remote_tp,
                });
            }
            (local_tp / remote_tp) as i64
        } else {
            if remote_tp % local_tp != 0 {
                return Err(TopologyError::NotDivisible {
                    local_tp,
                    remote_tp,
                });
            }
            -((remote_tp / local_tp) as i64)
        };
        Ok(TpMapping {
            local_tp,
            remote_tp,
            remote_pp: 1,
            ratio,
        })
    }

    /// The same TP pair toward a P with `remote_pp` pipeline stages
    /// (module docs: every stage's ranks are targets). Refuses 0 and a
    /// `tp × pp` that does not fit a `u32` rank number.
    pub const fn with_remote_pp(self, remote_pp: u32) -> Result<TpMapping, TopologyError> {
        if remote_pp == 0 || self.remote_tp.checked_mul(remote_pp).is_none() {
            return Err(TopologyError::BadPp {
                remote_tp: self.remote_tp,
                remote_pp,
            });
        }
        Ok(TpMapping { remote_pp, ..self })
    }

    /// P's pipeline-parallel size.
    pub const fn remote_pp(&self) -> u32 {
        self.remote_pp
    }

    /// The local (D) TP size.
    pub const fn local_tp(&self) -> u32 {
        self.local_tp
    }

    /// The remote (P) TP size.
    pub const fn remote_tp(&self) -> u32 {
        self.remote_tp
    }

    /// vLLM's `tp_ratio`: positive when local >= remote, negative otherwise,
    /// never 0 (equal sizes give 1).
    pub const fn tp_ratio(&self) -> i64 {
        self.ratio
    }

    /// How many remote ranks each local rank talks to: `|tp_ratio|` when
    /// the ratio is negative, else 1, times P's pipeline stages. Saturates
    /// at `u32::MAX` (a fan-out that large is refused by every user).
    pub const fn fan_out(&self) -> u32 {
        self.tp_fan_out().saturating_mul(self.remote_pp)
    }

    /// Remote ranks per stage: `|tp_ratio|` when negative, else 1.
    const fn tp_fan_out(&self) -> u32 {
        if self.ratio < 0 {
            // remote_tp / local_tp, which fits a u32.
            self.remote_tp / self.local_tp
        } else {
            1
        }
    }

    /// How many local (D) ranks read from each remote (P) rank: `tp_ratio`
    /// when it is positive (D TP / P TP), else 1.
    ///
    /// This is the `<n>` of the read-done `<id>:<n>` that each D rank sends
    /// to each P rank it read from, current vLLM's `plan.local_consumers`,
    /// and what P waits for per rank before it releases (see the module docs
    /// on which vLLM release we match).
    pub const fn consumers_per_p_rank(&self) -> u32 {
        if self.ratio > 0 {
            // local_tp / remote_tp, which fits a u32.
            self.local_tp / self.remote_tp
        } else {
            1
        }
    }

    /// The remote ranks local rank `rank` reads from and heartbeats, in
    /// ascending order: its TP targets on stage 0, then on stage 1, and so
    /// on. Always [`TpMapping::fan_out`] of them.
    pub const fn targets(&self, rank: u32) -> Result<RemoteRanks, TopologyError> {
        if rank >= self.local_tp {
            return Err(TopologyError::RankOutOfRange {
                rank,
                local_tp: self.local_tp,
            });
        }
        let (start, len) = if self.ratio > 0 {
            // ratio = local / remote fits a u32 and is >= 1.
            (rank / (self.local_tp / self.remote_tp), 1)
        } else {
            let k = self.remote_tp / self.local_tp;
            // rank < local_tp, so rank * k + k <= remote_tp: no overflow.
            (rank * k, k)
        };
        Ok(RemoteRanks {
            start,
            per_stage: len,
            stride: self.remote_tp,
            count: self.fan_out(),
            next: 0,
        })
    }
}

/// `tp_ratio` as vLLM computes it, for callers that need only the number.
pub const fn tp_ratio(local_tp: u32, remote_tp: u32) -> Result<i64, TopologyError> {
    match TpMapping::new(local_tp, remote_tp) {
        Ok(m) => Ok(m.tp_ratio()),
        Err(e) => Err(e),
    }
}

/// The remote ranks of one local rank: one contiguous range of TP ranks,
/// repeated on every pipeline stage (`stride` = remote TP apart), yielded in
/// order. Indexable ([`RemoteRanks::get`]) so that callers can keep per-peer
/// state by position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteRanks {
    /// The first TP rank on stage 0.
    start: u32,
    /// TP ranks per stage.
    per_stage: u32,
    /// Ranks between two stages' first ranks (the remote TP size).
    stride: u32,
    /// Targets in all.
    count: u32,
    /// The next position to yield.
    next: u32,
}

impl RemoteRanks {
    /// The first rank (stage 0's first TP target).
    pub const fn first(&self) -> u32 {
        self.start
    }

    /// The rank at position `k` (`0..fan_out`), whatever has been iterated.
    pub const fn get(&self, k: u32) -> Option<u32> {
        if k >= self.count || self.per_stage == 0 {
            return None;
        }
        // stage * stride + start + offset < remote_tp * remote_pp, which
        // with_remote_pp checked fits a u32.
        let stage = k / self.per_stage;
        Some(stage * self.stride + self.start + k % self.per_stage)
    }

    /// The position of `rank` among the targets, if it is one.
    pub const fn position(&self, rank: u32) -> Option<u32> {
        if self.stride == 0 {
            return None;
        }
        let (stage, tp) = (rank / self.stride, rank % self.stride);
        if tp < self.start || tp - self.start >= self.per_stage {
            return None;
        }
        let k = stage as u64 * self.per_stage as u64 + (tp - self.start) as u64;
        if k < self.count as u64 {
            Some(k as u32)
        } else {
            None
        }
    }
}

impl Iterator for RemoteRanks {
    type Item = u32;

    #[inline]
    fn next(&mut self) -> Option<u32> {
        let r = self.get(self.next)?;
        self.next += 1;
        Some(r)
    }

    #[inline]
    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.count.saturating_sub(self.next) as usize;
        (n, Some(n))
    }
}

impl ExactSizeIterator for RemoteRanks {}
impl FusedIterator for RemoteRanks {}

#[cfg(test)]
mod tests {
    use super::*;

    fn targets(local_tp: u32, remote_tp: u32, rank: u32) -> Vec<u32> {
        TpMapping::new(local_tp, remote_tp)
            .unwrap()
            .targets(rank)
            .unwrap()
            .collect()
    }

    #[test]
    fn p_tp4_d_tp2_each_d_rank_reads_two_p_ranks() {
        let m = TpMapping::new(2, 4).unwrap();
        assert_eq!(m.tp_ratio(), -2);
        assert_eq!(m.fan_out(), 2);
        assert_eq!(targets(2, 4, 0), [0, 1]);
        assert_eq!(targets(2, 4, 1), [2, 3]);
        assert_eq!(m.targets(1).unwrap().len(), 2);
    }

    #[test]
    fn p_tp2_d_tp4_two_d_ranks_share_one_p_rank() {
        let m = TpMapping::new(4, 2).unwrap();
        assert_eq!(m.tp_ratio(), 2);
        assert_eq!(m.fan_out(), 1);
        let all: Vec<Vec<u32>> = (0..4).map(|r| targets(4, 2, r)).collect();
        assert_eq!(all, [vec![0], vec![0], vec![1], vec![1]]);
    }

    #[test]
    fn equal_tp_maps_rank_to_itself() {
        let m = TpMapping::new(8, 8).unwrap();
        assert_eq!(m.tp_ratio(), 1);
        for r in 0..8 {
            assert_eq!(targets(8, 8, r), [r]);
        }
    }

    #[test]
    fn every_remote_rank_is_covered_exactly_as_often_as_expected() {
        for (local, remote) in [(1, 8), (2, 8), (8, 1), (8, 2), (4, 4), (3, 6), (6, 3)] {
            let m = TpMapping::new(local, remote).unwrap();
            let mut hits = vec![0u32; remote as usize];
            for r in 0..local {
                for p in m.targets(r).unwrap() {
                    hits[p as usize] += 1;
                }
            }
            let each = (local / remote).max(1);
            assert!(
                hits.iter().all(|&h| h == each),
                "{local}/{remote}: {hits:?}"
            );
        }
    }

    /// Current vLLM's `plan.local_consumers`, for (P TP, D TP): 1 when
    /// D TP <= P TP, D TP / P TP otherwise; and it is exactly how many D
    /// ranks have each P rank among their targets.
    #[test]
    fn consumers_per_p_rank_is_vllm_local_consumers() {
        for (p_tp, d_tp, local_consumers) in [(2, 2, 1), (4, 2, 1), (2, 4, 2), (1, 8, 8), (8, 1, 1)]
        {
            let m = TpMapping::new(d_tp, p_tp).unwrap();
            assert_eq!(
                m.consumers_per_p_rank(),
                local_consumers,
                "P {p_tp} D {d_tp}"
            );
            for p in 0..p_tp {
                let readers = (0..d_tp)
                    .filter(|&r| m.targets(r).unwrap().any(|t| t == p))
                    .count();
                assert_eq!(
                    readers, local_consumers as usize,
                    "P {p_tp} D {d_tp} rank {p}"
                );
            }
        }
    }

    #[test]
    fn bad_sizes_and_ranks_are_typed_errors() {
        assert_eq!(
            TpMapping::new(0, 4),
            Err(TopologyError::ZeroTp {
                local_tp: 0,
                remote_tp: 4
            })
        );
        assert!(matches!(
            TpMapping::new(4, 0),
            Err(TopologyError::ZeroTp { .. })
        ));
        assert_eq!(
            TpMapping::new(4, 3),
            Err(TopologyError::NotDivisible {
                local_tp: 4,
                remote_tp: 3
            })
        );
        assert!(matches!(
            TpMapping::new(2, 3),
            Err(TopologyError::NotDivisible { .. })
        ));
        let m = TpMapping::new(2, 4).unwrap();
        assert_eq!(
            m.targets(2),
            Err(TopologyError::RankOutOfRange {
                rank: 2,
                local_tp: 2
            })
        );
        assert!(m.targets(u32::MAX).is_err());
        assert_eq!(tp_ratio(1, 3), Ok(-3));
    }

    fn pp_targets(local_tp: u32, remote_tp: u32, remote_pp: u32, rank: u32) -> Vec<u32> {
        TpMapping::new(local_tp, remote_tp)
            .unwrap()
            .with_remote_pp(remote_pp)
            .unwrap()
            .targets(rank)
            .unwrap()
            .collect()
    }

    /// The issue's case: a P with PP > 1 has TP × PP ranks, and D must reach
    /// the later stages too (only `0..tp` before).
    #[test]
    fn every_pipeline_stage_is_a_target() {
        assert_eq!(pp_targets(1, 2, 2, 0), [0, 1, 2, 3]);
        assert_eq!(pp_targets(2, 4, 2, 1), [2, 3, 6, 7]);
        assert_eq!(pp_targets(4, 2, 3, 3), [1, 3, 5]);
        let m = TpMapping::new(2, 4).unwrap().with_remote_pp(2).unwrap();
        assert_eq!(m.fan_out(), 4);
        assert_eq!(m.consumers_per_p_rank(), 1);
        assert_eq!(m.remote_pp(), 2);
    }

    #[test]
    fn every_rank_of_every_stage_is_covered_as_often_as_its_readers() {
        for (local, remote, pp) in [(1, 8, 2), (2, 8, 3), (8, 1, 4), (8, 2, 2), (3, 6, 2)] {
            let m = TpMapping::new(local, remote)
                .unwrap()
                .with_remote_pp(pp)
                .unwrap();
            let mut hits = vec![0u32; (remote * pp) as usize];
            for r in 0..local {
                let t = m.targets(r).unwrap();
                assert_eq!(t.len(), m.fan_out() as usize);
                for (k, p) in t.enumerate() {
                    hits[p as usize] += 1;
                    assert_eq!(t.get(k as u32), Some(p));
                    assert_eq!(t.position(p), Some(k as u32), "{local}/{remote}x{pp}");
                }
                assert_eq!(t.get(m.fan_out()), None);
            }
            assert!(
                hits.iter().all(|&h| h == m.consumers_per_p_rank()),
                "{local}/{remote}x{pp}: {hits:?}"
            );
        }
    }

    #[test]
    fn position_refuses_ranks_that_are_not_targets() {
        let t = TpMapping::new(2, 4)
            .unwrap()
            .with_remote_pp(2)
            .unwrap()
            .targets(1)
            .unwrap();
        for r in [0, 1, 4, 5, 8, 9, u32::MAX] {
            assert_eq!(t.position(r), None, "{r}");
        }
    }

    #[test]
    fn bad_pp_sizes_are_typed_errors() {
        let m = TpMapping::new(1, 4).unwrap();
        assert!(matches!(
            m.with_remote_pp(0),
            Err(TopologyError::BadPp { .. })
        ));
        assert!(matches!(
            m.with_remote_pp(u32::MAX),
            Err(TopologyError::BadPp { .. })
        ));
    }

    #[test]
    fn extreme_sizes_do_not_overflow() {
        let m = TpMapping::new(1, u32::MAX).unwrap();
        assert_eq!(m.tp_ratio(), -i64::from(u32::MAX));
        let t = m.targets(0).unwrap();
        assert_eq!(t.len(), u32::MAX as usize);
        assert_eq!(t.first(), 0);
        let m = TpMapping::new(u32::MAX, 1).unwrap();
        assert_eq!(m.targets(u32::MAX - 1).unwrap().collect::<Vec<_>>(), [0]);
    }
}
