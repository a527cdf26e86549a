//! The design, inside the crate: what a lease is for, how the roles split,
//! the life of one lease and the invariants every test pins, the step
//! contract, and the layout of every packed word. Documentation only: this
//! module has no items. Each section names the module that owns the part.
//!
//! # What kvlease is for
//!
//! In disaggregated serving, the prefill engine (P) computes a request's KV
//! blocks and the decode engine (D) pulls them with RDMA READs. P must hold
//! the blocks until D has read them, but D may die, stall, or wait long in
//! its queue. kvlease holds them under a short **lease** that D renews with
//! **heartbeats** while it waits or reads; P reclaims within seconds when
//! the heartbeats stop. And because a lease can still lapse while D is alive
//! (lost heartbeats), D **verifies** after its READ that P still held the
//! blocks, so a lapse becomes a failed KV load instead of silently decoding
//! another request's KV.
//!
//! # Vocabulary
//!
//! One pair of names for the two sides, everywhere: **P** and **D**.
//!
//! | say | means | also seen as (kept where it is a name from outside) |
//! |---|---|---|
//! | P, the prefill side | the engine that computed the KV and holds it under a lease (push mode: the one that WRITEs it) | vLLM's `kv_producer`, this crate's `producer` module, SGLang's prefill server |
//! | D, the decode side | the engine that heartbeats, READs and verifies (push mode: grants write permits and fences) | vLLM's `kv_consumer`, this crate's `consumer` module, SGLang's decode server |
//!
//! The module names `producer` and `consumer` follow vLLM's `kv_role`
//! values and stay; types say the side the way engines do (`PrefillScheduler`,
//! `PrefillRank`, the plugin's `PrefillPushGuard` and `DecodePushGuard`).
//! Docs, comments, log lines and new code say P and D. "Sender" and
//! "receiver" name a message's direction only, never a side, since both
//! sides send (D sends heartbeats, P sends `PHB:` in push mode).
//!
//! # Roles
//!
//! Engines run a scheduler process plus one worker process per GPU, often
//! on several hosts, each worker with its own NIXL agent. kvlease splits the
//! same way; the halves talk through per-step bytes ([`crate::ipc`]) that
//! the engine ships over its own IPC:
//!
//! ```text
//!  P scheduler (one)                               P worker (one per TP rank)
//!    slot pool, nonce source                         its slot array (registered with its agent)
//!    grant: assign (slot, nonce) ──directive──▶      write the nonce into its slot this step
//!                                                    its heartbeats, read-dones, timers, expiry
//!    every rank reported? ◀──report(entry, nonce)──  zero its slot FIRST, then report
//!    engine freed the blocks ─▶ slot back to the pool
//!  D scheduler (one)                               D worker (one per TP rank)
//!    tracker: due engines ──heartbeat plan──▶        sender: HB / HBC to the P ranks it reads
//!    received, or the failure policy ◀──outcome──    verifier: one slot READ per P rank per step
//! ```
//!
//! Owners: [`crate::producer`] (`PrefillScheduler`, `PrefillRank`, and
//! `LeaseBook`, the two wired in one process), [`crate::consumer`]
//! (`HeartbeatTracker`, `HeartbeatSender`, `LeaseVerifier`), [`crate::ipc`]
//! (the role messages). Deadlines cross processes as remaining durations,
//! never as another process's instants. Ranks expire independently; blocks
//! are freed only once every rank reported; D's check fails on a rank that
//! zeroed its slot, so divergence fails closed.
//!
//! # The life of one lease (P)
//!
//! ```text
//!  prefill done ──grant(slot, nonce, expiry = now + duration)──▶ HELD
//!  HELD ──heartbeat──▶ HELD, expiry = max(expiry, now + extension)
//!  HELD ──read-done(id, nonce) × expected consumers──▶ RELEASED (read)
//!  HELD ──timer fires, expiry <= now──▶ RELEASED (expired)
//!  RELEASED ──every rank zeroed its slot and reported──▶ the engine frees the blocks
//!  the engine confirms the free ──▶ the slot goes back to the pool (only now)
//! ```
//!
//! # Invariants
//!
//! Numbered, because code and tests refer to them ("invariant 2"):
//!
//! 1. A slot holds a lease's nonce only while that lease's blocks are held:
//!    it is zeroed before the release is reported, and reused only after the
//!    engine freed the blocks.
//! 2. Nonces are never 0 and never repeat within a source's life, and are
//!    unpredictable across restarts; drawn ones are below 2^53, so they
//!    survive a router that decodes JSON numbers as float64
//!    ([`crate::nonce`]).
//! 3. A renewal never shortens a lease; a stale read-done (old nonce, same
//!    id) changes nothing.
//! 4. Expiry is never early; it is late by at most one timer tick plus one
//!    engine step ([`crate::wheel`]).
//! 5. Unknown ids, malformed messages, oversized ids, duplicate or late
//!    notifications are counted and reported, never a panic, never a lost or
//!    double-freed block.
//!
//! Why a matching nonce proves the lease held: P zeroes the slot before the
//! blocks can be reused, and D's slot READ starts after its block READs
//! completed, so a slot that still holds the nonce was held for the whole
//! READ. The read-done of a verified load goes out after the check, never
//! on the block READ (P would zero the slot first).
//!
//! # The step contract
//!
//! Each engine step calls each component once with `now`; the core never
//! reads a clock. Outputs go into caller buffers or callbacks. Capacities
//! (leases, slots, tracked requests, engines, ranks, id length, message
//! size) are fixed at construction from [`crate::LeaseConfig`]; exhaustion
//! is a typed error with a documented degraded behaviour (no slot: the lease
//! is granted without verification fields, and verifying decoders decline
//! it). Counting-allocator tests prove 0 heap allocations in steady steps.
//!
//! # Push mode: the same lease, the other way round
//!
//! In push mode P WRITEs into blocks D registered, and the hazard mirrors
//! pull mode's: D must not free (and reuse) a block while a WRITE into it
//! can still land, yet must not keep it for good when the WRITE cannot
//! come. [`crate::push`] makes the registration a **write permit** with a
//! deadline on D's clock: P posts only while the deadline, translated by
//! its clock-offset estimate and widened by the estimate's bound, is ahead;
//! a posted WRITE lands within an explicit `write_bound`; so at
//! `deadline + write_bound` (plus drift) on its own clock D may free without
//! P's word (the fence). P heartbeats D while it holds a registration
//! (`PHB:`), D renews the permit (`PRN:`), and every end P reports (`PEND:`
//! written, refused, ended) lets D free earlier. D's abort is a revocation
//! (`PRV:`): it ends on P's answer, given only once no WRITE is in flight,
//! or at the fence. Owners: `PushPermits` (D), `PushWrites` (P).
//!
//! ```text
//!  D: register ── permit(slot, nonce, deadline on D's clock) ──▶ P: gate open? post : refuse
//!     PHB: ◀── P holds it (every interval)     PRN: ──▶ later deadline
//!     PEND:W/R/X ◀── P's word: free now        PRV: ──▶ stop; answer when nothing is in flight
//!     no word by deadline + write_bound (+ drift): free (Lapsed / Revoked)
//! ```
//!
//! # Concurrency
//!
//! The engine loop owns the roles: no locks there. Shared state is small and
//! lock-free: the lease-slot array (read remotely while P writes it), the
//! slot pool (any thread may return a slot), the loopback queues. Every
//! atomic comes from one `sync` module that switches to loom's under
//! `--cfg loom`, so the loom models check the code that ships.
//!
//! # Wire formats
//!
//! - Notifications ([`crate::wire`]): `HB:id,id,...` and read-dones
//!   `id:consumers[:nonce=<16 hex>]`, byte-compatible with vLLM's
//!   NixlConnector, and two forms of (slot, nonce) records: compact `HBC:`
//!   (hex) and packed `HBP:` (six-bit digits, four times cheaper for P to
//!   decode; the vLLM plugin's D sends it).
//! - Clock re-samples ([`crate::clock_ping`]): `CLKPING:` / `CLKPONG:`.
//! - Role messages ([`crate::ipc`]): a versioned 32-byte header, fixed-size
//!   records, an id area.
//! - The lease advert an engine carries in its own handshake
//!   ([`crate::fabric::LeaseAdvert`]): `KVLA`, version 1, 32 bytes.
//!
//! # Packed words
//!
//! Four words pack several fields, each described by `pack::Field`
//! constants next to the code that uses it, and checked by one property test
//! (every field round-trips, and the fields of a word tile its 64 bits).
//!
//! The slot pool's head (`slot_pool`): a Treiber stack of free slot
//! indices; the tag is bumped on every pop, so a compare-and-swap that read
//! the head before another thread popped and pushed the same index fails
//! (the ABA guard, loom-checked):
//!
//! ```text
//!  63                               32 31                                0
//!  +----------------------------------+----------------------------------+
//!  |            tag (u32)             |   index of the first free slot   |
//!  +----------------------------------+----------------------------------+
//! ```
//!
//! A cell of the id index (`ids`): the entry, and the top half of the id's
//! hash, so that a probe rejects almost every wrong candidate without
//! reading its id bytes:
//!
//! ```text
//!  63                               32 31                                0
//!  +----------------------------------+----------------------------------+
//!  |        tag = hash >> 32          |              entry               |
//!  +----------------------------------+----------------------------------+
//! ```
//!
//! An [`XferId`](crate::fabric::XferId) (both fabrics): the READ's table
//! entry, and that entry's generation, bumped on every reuse so that a stale
//! id never names a later READ:
//!
//! ```text
//!  63                               32 31                                0
//!  +----------------------------------+----------------------------------+
//!  |           generation             |           table index            |
//!  +----------------------------------+----------------------------------+
//! ```
//!
//! A loopback agent's advert (`fabric::loopback`), one atomic word so that
//! a handshake reads it whole:
//!
//! ```text
//!   63       62      61                   32 31                            0
//!  +--------+--------+----------------------+-----------------------------+
//!  |present |compact | slot region (30 bits)|         slot count          |
//!  +--------+--------+----------------------+-----------------------------+
//! ```
//!
//! # Errors
//!
//! One error enum per module boundary, every variant documented; nothing
//! reachable from bytes off the wire, another process's messages or config
//! panics (the fuzz targets in `fuzz/` drive every decoder).
