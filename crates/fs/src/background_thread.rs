//! Background threads of a mount: checkpoints, journal commits and the
//! eviction of extent chunks.
//!
//! Only a checkpoint frees journal space. A commit that finds the journal
//! full runs one itself, so an `fsync` or a DSYNC write would wait for a
//! whole checkpoint. Instead, a commit that leaves the journal at least
//! half full asks the checkpoint thread for one: it runs while commits go
//! on appending behind it (see
//! [`VolumeInner::write_checkpoint`](crate::mount_state::VolumeInner)), and
//! the journal's space comes back before they can fill the other half.
//!
//! Likewise, metadata changes nobody syncs (allocating writes, creates)
//! are committed once their records reach the commit threshold, to bound
//! what a crash loses and what the queue holds. The change that crosses it
//! asks the commit thread instead of writing the journal itself; only a
//! writer that gets ahead of it by another threshold commits in its own
//! thread (see [`VolumeInner::commit_if_due`]).
//!
//! And extent chunks past the mount's budget are evicted by a third
//! thread, asked by the page loader (see [`crate::extent_cache`]).
//!
//! Like the flusher, a thread holds the volume only while it works and
//! stops, joined, when the last [`crate::Volume`] handle is dropped: after
//! that nothing of this mount runs in the background (a crash test's
//! dropped volume stays dropped).

use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

use crate::background_request::BackgroundRequest;
use crate::mount_state::VolumeInner;
use crate::{Error, Result};

/// One background thread of a mount; dropping it stops and joins it.
pub(crate) struct BackgroundThread {
    request: Arc<BackgroundRequest>,
    thread: Option<JoinHandle<()>>,
}

impl BackgroundThread {
    /// The checkpoint thread, asked through `vol.checkpoint_request`.
    pub(crate) fn checkpoints(vol: &Arc<VolumeInner>) -> Result<BackgroundThread> {
        let request = vol.checkpoint_request.clone();
        BackgroundThread::start(vol, "iomapfs-checkpoint", request, |vol| {
            vol.checkpoint_if_due()
        })
    }

    /// The commit thread, asked through `vol.commit_request`.
    pub(crate) fn commits(vol: &Arc<VolumeInner>) -> Result<BackgroundThread> {
        let request = vol.commit_request.clone();
        BackgroundThread::start(vol, "iomapfs-commit", request, |vol| {
            vol.commit_if_still_due()
        })
    }

    /// The evictor of extent chunks past the mount's budget, asked through
    /// the page loader's request (see [`crate::extent_cache`]).
    pub(crate) fn evictor(vol: &Arc<VolumeInner>) -> Result<BackgroundThread> {
        let request = match &vol.page_loader {
            Some(loader) => loader.evict_request.clone(),
            None => Arc::default(),
        };
        BackgroundThread::start(vol, "iomapfs-evict", request, |vol| {
            vol.evict_extent_chunks();
            Ok(())
        })
    }

    fn start(
        vol: &Arc<VolumeInner>,
        name: &str,
        request: Arc<BackgroundRequest>,
        job: fn(&VolumeInner) -> Result<()>,
    ) -> Result<BackgroundThread> {
        let thread = {
            let (weak, request) = (Arc::downgrade(vol), request.clone());
            std::thread::Builder::new()
                .name(name.to_string())
                .spawn(move || run(weak, &request, job))
                .map_err(|e| Error::invalid(format!("background thread {name}"), e.to_string()))?
        };
        request.serve();
        Ok(BackgroundThread {
            request,
            thread: Some(thread),
        })
    }
}

impl Drop for BackgroundThread {
    fn drop(&mut self) {
        self.request.stop();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run(vol: Weak<VolumeInner>, request: &BackgroundRequest, job: fn(&VolumeInner) -> Result<()>) {
    while request.take() {
        let Some(vol) = vol.upgrade() else {
            return request.finished();
        };
        if vol.check_live().is_err() {
            return request.finished();
        }
        // A failed checkpoint or commit shuts the volume down: every later
        // call reports it, so there is nobody to hand the error to here.
        let _ = job(&vol);
        drop(vol);
        request.finished();
    }
}
