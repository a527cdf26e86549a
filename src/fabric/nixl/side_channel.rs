//! kvlease's own handshake side channel: the listener thread and the
//! client threads that answer with our NIXL metadata and advert (each
//! client bounded by a deadline, their number by the configuration), the
//! client exchange, and the bounded parser of the answer (see the module
//! docs of [`crate::fabric::nixl`], "Handshake: our own side channel" and
//! "Failure model"). It never touches the NIXL agent.

use super::*;

/// The listener's counters, shared between its threads and the fabric.
#[derive(Default)]
pub(super) struct ClientCounters {
    /// Client threads running now.
    active: AtomicU32,
    answered: AtomicU64,
    refused: AtomicU64,
}

impl ClientCounters {
    /// (answered, refused) so far.
    pub(super) fn snapshot(&self) -> (u64, u64) {
        (
            self.answered.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
        )
    }
}

pub(super) fn start_listener(
    addr: SocketAddr,
    advert: Arc<Mutex<Arc<Vec<u8>>>>,
    clock: MonotonicClock,
    max_clients: usize,
) -> Result<Listener, NixlInitError> {
    let socket = TcpListener::bind(addr).map_err(|e| NixlInitError::Listen(e.kind()))?;
    let bound = socket
        .local_addr()
        .map_err(|e| NixlInitError::Listen(e.kind()))?;
    let stop = Arc::new(AtomicU32::new(0));
    let counters = Arc::new(ClientCounters::default());
    let stop_thread = stop.clone();
    let counters_thread = counters.clone();
    let max_clients = u32::try_from(max_clients).unwrap_or(u32::MAX);
    let thread = std::thread::Builder::new()
        .name("kvlease-nixl-listen".into())
        .spawn(move || {
            serve(
                socket,
                stop_thread,
                advert,
                clock,
                counters_thread,
                max_clients,
            )
        })
        .map_err(|e| NixlInitError::Listen(e.kind()))?;
    Ok(Listener {
        addr: bound,
        stop,
        thread: Some(thread),
        counters,
    })
}

/// The accept loop: each client gets a thread of its own and
/// [`LISTENER_CLIENT_DEADLINE`] for its whole exchange, so a client that
/// stalls delays nobody else. At most `max_clients` are served at once; a
/// client beyond them is disconnected at once rather than queued behind
/// stalled ones.
pub(super) fn serve(
    socket: TcpListener,
    stop: Arc<AtomicU32>,
    advert: Arc<Mutex<Arc<Vec<u8>>>>,
    clock: MonotonicClock,
    counters: Arc<ClientCounters>,
    max_clients: u32,
) {
    loop {
        let conn = socket.accept();
        if stop.load(Ordering::SeqCst) != 0 {
            return;
        }
        let stream = match conn {
            Ok((stream, _)) => stream,
            // E.g. out of file descriptors: do not spin.
            Err(_) => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        // Only this thread increments, so check-then-add cannot overshoot.
        if counters.active.load(Ordering::Acquire) >= max_clients {
            counters.refused.fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        }
        counters.active.fetch_add(1, Ordering::AcqRel);
        let advert = advert.clone();
        let client_counters = counters.clone();
        let spawned = std::thread::Builder::new()
            .name("kvlease-nixl-client".into())
            .stack_size(CLIENT_THREAD_STACK)
            .spawn(move || {
                let deadline = std::time::Instant::now() + LISTENER_CLIENT_DEADLINE;
                if answer(stream, &advert, clock, deadline).is_ok() {
                    client_counters.answered.fetch_add(1, Ordering::Relaxed);
                }
                client_counters.active.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            // The closure (and the stream) was dropped: the client sees a
            // closed connection and retries.
            counters.active.fetch_sub(1, Ordering::AcqRel);
            counters.refused.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Time left until `deadline`, as a socket timeout; `TimedOut` when none.
fn left(deadline: std::time::Instant) -> io::Result<Duration> {
    deadline
        .checked_duration_since(std::time::Instant::now())
        .filter(|d| !d.is_zero())
        .ok_or_else(|| io::ErrorKind::TimedOut.into())
}

/// `read_exact` that gives up at `deadline` however the bytes trickle in
/// (a socket timeout alone bounds each read, not their sum).
fn read_until(
    stream: &mut TcpStream,
    mut buf: &mut [u8],
    deadline: std::time::Instant,
) -> io::Result<()> {
    while !buf.is_empty() {
        stream.set_read_timeout(Some(left(deadline)?))?;
        match stream.read(buf) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `write_all` that gives up at `deadline`.
fn write_until(
    stream: &mut TcpStream,
    mut buf: &[u8],
    deadline: std::time::Instant,
) -> io::Result<()> {
    while !buf.is_empty() {
        stream.set_write_timeout(Some(left(deadline)?))?;
        match stream.write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub(super) fn answer(
    mut stream: TcpStream,
    advert: &Mutex<Arc<Vec<u8>>>,
    clock: MonotonicClock,
    deadline: std::time::Instant,
) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let mut req = [0u8; REQUEST_LEN];
    read_until(&mut stream, &mut req, deadline)?;
    if u32::from_le_bytes([req[0], req[1], req[2], req[3]]) != MAGIC
        || u16::from_le_bytes([req[4], req[5]]) != VERSION
    {
        return Err(io::ErrorKind::InvalidData.into());
    }
    let body = advert.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let body_len = u32::try_from(body.len()).map_err(|_| io::ErrorKind::InvalidData)?;
    let mut header = [0u8; HEADER_LEN];
    header[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    header[4..6].copy_from_slice(&VERSION.to_le_bytes());
    header[8..16].copy_from_slice(&clock.now().as_nanos().to_le_bytes());
    header[16..20].copy_from_slice(&body_len.to_le_bytes());
    write_until(&mut stream, &header, deadline)?;
    write_until(&mut stream, &body, deadline)?;
    stream.flush()
}

pub(super) fn io_error(e: io::Error) -> FabricError {
    match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => FabricError::TimedOut,
        _ => FabricError::PeerUnreachable,
    }
}

/// The client side, on the handshake thread: connect, ask, read, parse.
pub(super) fn exchange(
    address: &str,
    clock: MonotonicClock,
    timeout: Duration,
) -> Result<Reply, FabricError> {
    let start = std::time::Instant::now();
    let remaining = || {
        timeout
            .checked_sub(start.elapsed())
            .filter(|d| !d.is_zero())
            .ok_or(FabricError::TimedOut)
    };
    let addrs: Vec<SocketAddr> = match address.parse::<SocketAddr>() {
        Ok(a) => vec![a],
        Err(_) => address
            .to_socket_addrs()
            .map_err(|_| FabricError::BadAddress)?
            .collect(),
    };
    if addrs.is_empty() {
        return Err(FabricError::BadAddress);
    }
    let mut stream = None;
    let mut last = FabricError::PeerUnreachable;
    for a in &addrs {
        match TcpStream::connect_timeout(a, remaining()?) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = io_error(e),
        }
    }
    let mut stream = stream.ok_or(last)?;
    stream.set_nodelay(true).map_err(io_error)?;
    stream
        .set_write_timeout(Some(remaining()?))
        .map_err(io_error)?;
    let mut req = [0u8; REQUEST_LEN];
    req[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    req[4..6].copy_from_slice(&VERSION.to_le_bytes());
    let local_send = clock.now();
    stream.write_all(&req).map_err(io_error)?;
    stream
        .set_read_timeout(Some(remaining()?))
        .map_err(io_error)?;
    let mut header = [0u8; HEADER_LEN];
    stream.read_exact(&mut header).map_err(io_error)?;
    let local_recv = clock.now();
    let mut h = Cursor::new(&header);
    if h.u32()? != MAGIC || h.u16()? != VERSION {
        return Err(FabricError::PeerUnreachable);
    }
    let _flags = h.u16()?;
    let remote = Instant::from_nanos(h.u64()?);
    let body_len = h.u32()? as usize;
    if body_len > MAX_BODY_LEN {
        return Err(FabricError::PeerUnreachable);
    }
    let mut body = vec![0u8; body_len];
    stream
        .set_read_timeout(Some(remaining()?))
        .map_err(io_error)?;
    stream.read_exact(&mut body).map_err(io_error)?;
    let clock = ClockSample {
        local_send,
        remote,
        local_recv,
    };
    parse_body(&body, clock)
}

/// Parses an answer body. Every length is bounded; garbage is
/// `PeerUnreachable` ("answered garbage"), never a panic.
pub(super) fn parse_body(body: &[u8], clock: ClockSample) -> Result<Reply, FabricError> {
    let mut c = Cursor::new(body);
    let name_len = c.u16()? as usize;
    if name_len == 0 || name_len > MAX_NAME_LEN {
        return Err(FabricError::PeerUnreachable);
    }
    let name = std::str::from_utf8(c.bytes(name_len)?)
        .map_err(|_| FabricError::PeerUnreachable)?
        .to_owned();
    if name.contains('\0') {
        return Err(FabricError::PeerUnreachable);
    }
    let slot_region = c.u32()?;
    let slot_count = c.u32()?;
    let compact = match c.u8()? {
        0 => false,
        1 => true,
        _ => return Err(FabricError::PeerUnreachable),
    };
    let region_count = c.u32()? as usize;
    if region_count > MAX_REGIONS || region_count > c.remaining() / 16 {
        return Err(FabricError::PeerUnreachable);
    }
    let mut regions = Vec::with_capacity(region_count);
    for _ in 0..region_count {
        let addr = c.u64()?;
        let len = c.u64()?;
        if addr.checked_add(len).is_none() {
            return Err(FabricError::PeerUnreachable);
        }
        regions.push((addr, len));
    }
    let slot_region = match slot_region {
        NO_REGION => None,
        r if (r as usize) < region_count => Some(r),
        _ => return Err(FabricError::PeerUnreachable),
    };
    if let Some(r) = slot_region {
        // The slot array must hold slot_count words.
        if u64::from(slot_count) * 8 > regions[r as usize].1 {
            return Err(FabricError::PeerUnreachable);
        }
    }
    let md_len = c.u32()? as usize;
    let md = c.bytes(md_len)?.to_vec();
    if md.is_empty() || c.remaining() != 0 {
        return Err(FabricError::PeerUnreachable);
    }
    Ok(Reply {
        name,
        slot_region,
        slot_count: if slot_region.is_some() { slot_count } else { 0 },
        compact,
        regions,
        md,
        clock: Some(clock),
    })
}

/// A bounds-checked little-endian reader.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Cursor<'a> {
        Cursor { buf, pos: 0 }
    }

    pub(super) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(super) fn bytes(&mut self, n: usize) -> Result<&'a [u8], FabricError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(FabricError::PeerUnreachable)?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    pub(super) fn array<const N: usize>(&mut self) -> Result<[u8; N], FabricError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.bytes(N)?);
        Ok(a)
    }

    pub(super) fn u8(&mut self) -> Result<u8, FabricError> {
        Ok(self.array::<1>()?[0])
    }

    pub(super) fn u16(&mut self) -> Result<u16, FabricError> {
        self.array().map(u16::from_le_bytes)
    }

    pub(super) fn u32(&mut self) -> Result<u32, FabricError> {
        self.array().map(u32::from_le_bytes)
    }

    pub(super) fn u64(&mut self) -> Result<u64, FabricError> {
        self.array().map(u64::from_le_bytes)
    }
}
