//! libfabric transport (not yet implemented in this build).

use std::sync::Arc;

use super::{BackendConfig, Kind, Transport, TransportWorker};
use crate::error::{Code, Error, Result};
use crate::memory::LocalMemory;
use crate::metadata::SegmentDesc;

pub struct FabricTransport;

impl FabricTransport {
    pub fn start(_config: &BackendConfig, _memory: Arc<LocalMemory>) -> Result<FabricTransport> {
        Err(Error::new(
            Code::BackendUnavailable,
            "the libfabric transport is not implemented in this build yet (libfabric is never loaded)",
        ))
    }
}

impl Transport for FabricTransport {
    fn kind(&self) -> Kind {
        Kind::Fabric
    }

    fn describe(&self, _desc: &mut SegmentDesc) {}

    fn reaches(&self, _peer: &SegmentDesc) -> bool {
        false
    }

    fn slice_size(&self) -> u64 {
        64 << 10
    }

    fn new_worker(&self) -> Result<Box<dyn TransportWorker>> {
        Err(Error::new(
            Code::BackendUnavailable,
            "libfabric transport unavailable",
        ))
    }
}
