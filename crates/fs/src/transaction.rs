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
use crate::mount_state::{CommitState, VolumeInner};
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
        let result = self.write_checkpoint(commit);
        if let Err(err) = &result {
            self.shut_down(err);
        }
        result
    }

    /// Takes a snapshot of the metadata under the metadata lock, then
    /// flushes, encodes and writes it with the lock released, so reads,
    /// overwrites and allocating writes go on meanwhile.
    ///
    /// The snapshot is a clone of [`crate::state::MetaState`], O(1) because
    /// the inode table and each inode's maps are copy-on-write: the lock is
    /// held for a time that does not grow with the metadata. Changes made
    /// while the checkpoint is written stay pending with sequence numbers
    /// from the snapshot's `next_seq` on, which is exactly where the new
    /// checkpoint's journal starts, so the next commit journals them after
    /// it; space they free stays busy until then (`mark_committed` below
    /// releases only what the snapshot covers). The commit lock, held by the
    /// caller, keeps the journal still meanwhile.
    fn write_checkpoint(&self, commit: &mut CommitState) -> Result<()> {
        let (snapshot, journal_seq) = {
            let mut meta = self.meta.write();
            // Write times still in core go into the snapshot too.
            meta.log_write_times()?;
            // The snapshot holds every record applied so far.
            meta.pending.clear();
            meta.pending_bytes = 0;
            (meta.state.clone(), meta.next_seq)
        };
        // After the snapshot, so it covers the data of every write whose
        // completion the snapshot records.
        self.dev
            .flush()
            .map_err(|e| Error::device("checkpoint: flush", e))?;
        let ckpt = Checkpoint {
            generation: commit.generation + 1,
            journal_start: commit.journal.head(),
            journal_seq,
            journal_chain: commit.journal.chain(),
            image: snapshot.to_image(),
        };
        // Dropped before the write: while it lives, each change copies what
        // it touches.
        drop(snapshot);
        let slot = 1 - commit.slot;
        checkpoint::write_checkpoint(&*self.dev, &self.sb, slot, &ckpt)?;
        let (older_slot, older_generation) = (commit.slot, commit.generation);
        commit.slot = slot;
        commit.generation = ckpt.generation;
        commit.journal = JournalWriter::new(
            &self.sb,
            ckpt.journal_start,
            ckpt.journal_seq,
            ckpt.journal_chain,
        );
        // From here on, losing the new checkpoint is damage, not a torn
        // write: the mark tells the next mount so. Before the space the
        // snapshot freed is reused, so that no rollback the mark would not
        // report can show it.
        checkpoint::mark_superseded(&*self.dev, &self.sb, older_slot, older_generation)?;
        let mut meta = self.meta.write();
        meta.mark_committed(journal_seq - 1);
        // Space the snapshot's records freed is free for good now.
        meta.alloc.release_busy(journal_seq - 1);
        Ok(())
    }
}
