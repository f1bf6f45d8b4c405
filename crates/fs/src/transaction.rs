//! Making changes durable: group commit of the journal, checkpoints that
//! trim it, and the shutdown that follows when either fails.
//!
//! Fault model: the device may lose or tear any write not followed by a
//! completed flush, and may fail any request. A failed journal commit or
//! checkpoint leaves memory ahead of the disk, so the volume shuts down: every
//! later call fails with [`Error::Shutdown`] and the next mount recovers from
//! what is durable.

use crate::checkpoint::{self, Checkpoint};
use crate::journal::JournalWriter;
use crate::mount_state::{CommitState, Meta, VolumeInner};
use crate::{Error, Result};

impl VolumeInner {
    /// Commits when enough uncommitted metadata has piled up.
    pub fn commit_if_due(&self) -> Result<()> {
        let due = self.meta.read().pending_bytes >= self.commit_threshold;
        if due {
            self.commit()
        } else {
            Ok(())
        }
    }

    /// Group commit: makes every change applied so far durable, together with
    /// the data I/O that completed before them. Concurrent callers queue on
    /// the commit lock and the first one in writes everybody's records.
    pub fn commit(&self) -> Result<()> {
        self.check_live()?;
        let mut commit = self.commit.lock();
        self.check_live()?;
        let (records, last_seq) = {
            let mut meta = self.meta.write();
            if !meta.pending.is_empty() {
                // A batch is written anyway: pending write times ride along.
                meta.log_write_times()?;
            }
            meta.pending_bytes = 0;
            (std::mem::take(&mut meta.pending), meta.next_seq - 1)
        };
        // The preflush makes the data whose completion these records describe
        // durable before the records can be; without records, it is the whole
        // of fsync.
        if let Err(e) = self.dev.flush() {
            let err = Error::device("journal commit: flush", e);
            if !records.is_empty() {
                self.shut_down(&err);
            }
            return Err(err);
        }
        if records.is_empty() {
            return Ok(());
        }
        if commit.journal.batch_bytes(&records) > commit.journal.free_bytes() {
            // The checkpoint captures the in-memory state, which already
            // contains these records.
            return self.checkpoint_locked(&mut commit);
        }
        let result = commit.journal.append(&*self.dev, &records).and_then(|_| {
            self.dev
                .flush()
                .map_err(|e| Error::device("journal commit: flush", e))
        });
        if let Err(err) = result {
            self.shut_down(&err);
            return Err(err);
        }
        self.meta.write().mark_committed(last_seq);
        Ok(())
    }

    /// Writes a checkpoint and trims the journal.
    pub(crate) fn checkpoint(&self) -> Result<()> {
        self.check_live()?;
        let mut commit = self.commit.lock();
        self.checkpoint_locked(&mut commit)
    }

    fn checkpoint_locked(&self, commit: &mut CommitState) -> Result<()> {
        self.check_live()?;
        let mut meta = self.meta.write();
        let result = self.write_checkpoint(commit, &mut meta);
        if let Err(err) = &result {
            self.shut_down(err);
        }
        result
    }

    fn write_checkpoint(&self, commit: &mut CommitState, meta: &mut Meta) -> Result<()> {
        meta.log_write_times()?;
        self.dev
            .flush()
            .map_err(|e| Error::device("checkpoint: flush", e))?;
        let ckpt = Checkpoint {
            generation: commit.generation + 1,
            journal_start: commit.journal.head(),
            journal_seq: meta.next_seq,
            journal_chain: commit.journal.chain(),
            image: meta.state.to_image(),
        };
        let slot = 1 - commit.slot;
        checkpoint::write_checkpoint(&*self.dev, &self.sb, slot, &ckpt)?;
        commit.slot = slot;
        commit.generation = ckpt.generation;
        commit.journal = JournalWriter::new(
            &self.sb,
            ckpt.journal_start,
            ckpt.journal_seq,
            ckpt.journal_chain,
        );
        meta.pending.clear();
        meta.pending_bytes = 0;
        let last_seq = meta.next_seq - 1;
        meta.mark_committed(last_seq);
        Ok(())
    }
}
