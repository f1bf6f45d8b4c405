//! Background checkpoints.
//!
//! Only a checkpoint frees journal space. A commit that finds the journal
//! full runs one itself, so an `fsync` or a DSYNC write would wait for a
//! whole checkpoint. Instead, a commit that leaves the journal at least
//! half full asks this thread (one per mount) for a checkpoint: it runs
//! while commits go on appending behind it (see
//! [`VolumeInner::write_checkpoint`](crate::mount_state::VolumeInner)), and
//! the journal's space comes back before they can fill the other half.
//!
//! Like the flusher, the thread holds the volume only while it works and
//! stops, joined, when the last [`crate::Volume`] handle is dropped: after
//! that nothing of this mount checkpoints in the background (a crash test's
//! dropped volume stays dropped).

use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

use crate::checkpoint_request::CheckpointRequest;
use crate::mount_state::VolumeInner;
use crate::{Error, Result};

/// The background checkpoint thread of one mount; dropping it stops and
/// joins it.
pub(crate) struct Checkpointer {
    request: Arc<CheckpointRequest>,
    thread: Option<JoinHandle<()>>,
}

impl Checkpointer {
    pub(crate) fn start(vol: &Arc<VolumeInner>) -> Result<Checkpointer> {
        let request = vol.checkpoint_request.clone();
        let thread = {
            let (weak, request) = (Arc::downgrade(vol), request.clone());
            std::thread::Builder::new()
                .name("iomapfs-checkpoint".to_string())
                .spawn(move || run(weak, &request))
                .map_err(|e| Error::invalid("background checkpoints", e.to_string()))?
        };
        Ok(Checkpointer {
            request,
            thread: Some(thread),
        })
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.request.stop();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run(vol: Weak<VolumeInner>, request: &CheckpointRequest) {
    while request.take() {
        let Some(vol) = vol.upgrade() else {
            return request.finished();
        };
        if vol.check_live().is_err() {
            return request.finished();
        }
        // A failed checkpoint shuts the volume down: every later call
        // reports it, so there is nobody to hand the error to here.
        let _ = vol.checkpoint_if_half_full();
        drop(vol);
        request.finished();
    }
}
