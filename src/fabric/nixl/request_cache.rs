//! The prepared READ requests: one NIXL transfer request per (peer,
//! descriptor set), created on first use, re-posted after (see the module
//! docs of [`crate::fabric::nixl`], "READs: prepared requests, re-posted").

use super::*;

impl NixlFabric {
    /// Releases cached request `ci` (NIXL aborts it if it is in flight).
    pub(super) fn drop_cached(&mut self, ci: usize) {
        if let Some(c) = self.cache.get_mut(ci).and_then(Option::take) {
            if let Some(list) = self.cache_index.get_mut(&(c.peer, c.hash)) {
                list.retain(|&x| x != ci);
                if list.is_empty() {
                    self.cache_index.remove(&(c.peer, c.hash));
                }
            }
            self.cache_free.push(ci as u32);
            drop(c);
        }
    }

    pub(super) fn find_idle(&self, peer: u32, hash: u64, descs: &[ReadDesc]) -> Option<usize> {
        let list = self.cache_index.get(&(peer, hash))?;
        list.iter()
            .copied()
            .find(|&ci| matches!(&self.cache[ci], Some(c) if !c.busy && *c.descs == *descs))
    }

    /// Creates and caches a request for `descs` (the allocating path).
    pub(super) fn create_cached(
        &mut self,
        peer: u32,
        hash: u64,
        descs: &[ReadDesc],
    ) -> Result<usize, FabricError> {
        let ci = match self.cache_free.pop().map(|c| c as usize) {
            Some(ci) => ci,
            None => {
                // Evict the least recently used idle request.
                let victim = self
                    .cache
                    .iter()
                    .enumerate()
                    .filter_map(|(i, c)| c.as_ref().filter(|c| !c.busy).map(|c| (c.last_used, i)))
                    .min()
                    .map(|(_, i)| i)
                    .ok_or(FabricError::Full)?;
                self.drop_cached(victim);
                self.cache_free.pop().ok_or(FabricError::Full)? as usize
            }
        };
        let built = self.build_request(peer as usize, descs);
        let req = match built {
            Ok(req) => req,
            Err(e) => {
                self.cache_free.push(ci as u32);
                return Err(e);
            }
        };
        self.cache[ci] = Some(Cached {
            peer,
            hash,
            descs: descs.into(),
            req,
            busy: false,
            last_used: 0,
        });
        self.cache_index.entry((peer, hash)).or_default().push(ci);
        Ok(ci)
    }

    pub(super) fn build_request(
        &self,
        peer: usize,
        descs: &[ReadDesc],
    ) -> Result<XferRequest, FabricError> {
        let Some(p) = self.peers.get(peer) else {
            return Err(FabricError::UnknownAgent);
        };
        let (PeerState::Ready { regions, .. }, Some(name)) = (&p.state, &p.name) else {
            return Err(FabricError::NotConnected);
        };
        let mut local = XferDescList::new(MemType::Dram).map_err(backend)?;
        let mut remote = XferDescList::new(MemType::Dram).map_err(backend)?;
        for d in descs {
            // Bounds were checked by post_read; these cannot overflow.
            let l = &self.regions[d.local.0 as usize];
            let (raddr, _) = regions[d.remote.0 as usize];
            local.add_desc(l.addr + d.local_offset as usize, d.len as usize, 0);
            remote.add_desc((raddr + d.remote_offset) as usize, d.len as usize, 0);
        }
        self.agent
            .create_xfer_req(XferOp::Read, &local, &remote, name, None)
            .map_err(backend)
    }
}

pub(super) fn desc_hash(descs: &[ReadDesc]) -> u64 {
    let mut h = FxHasher::default();
    for d in descs {
        (
            d.local.0,
            d.local_offset,
            d.remote.0,
            d.remote_offset,
            d.len,
        )
            .hash(&mut h);
    }
    h.finish()
}
