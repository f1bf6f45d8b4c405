//! A random workload that drives a volume and records every state it could
//! leave behind in a [`History`]: the engine of the power-cut and
//! device-error suites.

use std::sync::Arc;

use blockdev::BlockDevice;
use iomapfs_fs::{Error, File, OpenFlags, SetAttr, Volume, XattrSet};

use super::history::{tagged, History, Id, Namespace, Window};
use super::volstate::{parent_of, read_volume, VolState};
use super::{Rng, SmallRng};

pub const ROOT_NAMES: &[&str] = &["a", "b", "c", "f"];
pub const DIRS: &[&str] = &["/d", "/e"];
pub const DIR_NAMES: &[&str] = &["x", "y"];
/// Where symlinks live: names no other op uses.
pub const SYMLINK_PATHS: &[&str] = &["/s0", "/s1"];
const XATTR_NAMES: &[&str] = &["user.a", "user.b"];

pub struct WHandle {
    pub id: Id,
    pub file: File,
    pub direct: bool,
    pub dsync: bool,
    /// Its file was unlinked or replaced since it was opened.
    pub orphan: bool,
}

#[derive(Clone, Debug)]
pub struct WorkloadCfg {
    /// Largest file offset written, truncated or allocated to.
    pub max_file: u64,
    /// Largest single write.
    pub max_write: u64,
    /// Most handles kept open at once.
    pub max_handles: usize,
    /// Probability of comparing a file with the model after an op.
    pub live_check: f64,
    /// Allow remounts that drop the volume without unmount or sync.
    pub crash_remounts: bool,
    /// Share of writes that are strided: one block at every other block,
    /// so a file gets an extent per block written (files with many
    /// extents, which volumes with extent pages page).
    pub strided_writes: f64,
}

impl Default for WorkloadCfg {
    fn default() -> Self {
        WorkloadCfg {
            max_file: 64 * 1024,
            max_write: 16 * 1024,
            max_handles: 6,
            live_check: 0.1,
            crash_remounts: !super::skip("eof-tail"),
            strided_writes: 0.0,
        }
    }
}

pub struct Workload {
    pub vol: Option<Volume>,
    pub dev: Arc<dyn BlockDevice>,
    pub h: History,
    pub handles: Vec<WHandle>,
    pub rng: SmallRng,
    pub cfg: WorkloadCfg,
    next_wid: u64,
    lbs: u64,
    /// Set once an operation failed: everything after is uncertain.
    pub failed: Option<String>,
}

/// The result of one library call inside a workload op.
type R<T> = std::result::Result<T, Error>;

impl Workload {
    /// `dev` must hold a freshly formatted volume.
    pub fn new(dev: Arc<dyn BlockDevice>, rng: SmallRng, cfg: WorkloadCfg) -> Workload {
        let lbs = u64::from(dev.caps().logical_block_size);
        let vol =
            crate::common::open_replayable(dev.clone()).expect("open freshly formatted volume");
        Workload {
            vol: Some(vol),
            dev,
            h: History::new(),
            handles: Vec::new(),
            rng,
            cfg,
            next_wid: 0,
            lbs,
            failed: None,
        }
    }

    pub fn vol(&self) -> &Volume {
        self.vol.as_ref().expect("volume is mounted")
    }

    fn file_paths(&self) -> Vec<String> {
        let mut v: Vec<String> = ROOT_NAMES.iter().map(|n| format!("/{n}")).collect();
        for d in DIRS {
            for n in DIR_NAMES {
                v.push(format!("{d}/{n}"));
            }
        }
        v
    }

    fn existing_files(&self) -> Vec<String> {
        self.h.ns.files.keys().cloned().collect()
    }

    fn pick<T: Clone>(&mut self, v: &[T]) -> Option<T> {
        if v.is_empty() {
            None
        } else {
            Some(v[self.rng.gen_range(0..v.len())].clone())
        }
    }

    /// Ends the op in progress: on `Err`, records the failure (its effect is
    /// uncertain, so the model keeps it as possible) and stops the workload.
    fn finish<T>(&mut self, what: &str, r: R<T>) -> Option<T> {
        match r {
            Ok(v) => {
                self.h.end();
                Some(v)
            }
            Err(e) => {
                self.h.end_failed();
                self.failed = Some(format!("{what}: {e}"));
                None
            }
        }
    }

    /// Handles of `id` become orphans once its last name is gone.
    fn mark_orphans(&mut self, id: Id) {
        if self.h.ns.contains_id(id) {
            return;
        }
        for h in &mut self.handles {
            if h.id == id {
                h.orphan = true;
            }
        }
    }

    fn new_wid(&mut self) -> u64 {
        self.next_wid += 1;
        self.h.max_wid = self.next_wid;
        self.next_wid
    }

    /// Runs one random operation. Returns `false` once an op has failed.
    pub fn step(&mut self) -> bool {
        if self.failed.is_some() {
            return false;
        }
        let roll = self.rng.gen_range(0..100);
        match roll {
            0..=9 => self.op_create(),
            10..=44 if self.rng.gen_bool(self.cfg.strided_writes) => self.op_strided_write(),
            10..=44 => self.op_write(),
            45..=49 => self.op_truncate(),
            50..=53 => self.op_fallocate(),
            54..=57 => self.op_punch(),
            58..=63 => self.op_rename(),
            64..=67 => self.op_unlink(),
            68..=70 => self.op_dir(),
            71..=80 => self.op_fsync(),
            81..=82 => self.op_sync(),
            83..=84 => self.op_checkpoint(),
            85..=88 => self.op_close(),
            89 => self.op_remount(),
            90..=94 => self.op_async(),
            _ => self.op_meta(),
        }
        if self.failed.is_none() && self.rng.gen_bool(self.cfg.live_check) {
            self.live_check_one();
        }
        self.failed.is_none()
    }

    fn random_flags(&mut self) -> OpenFlags {
        OpenFlags {
            direct: self.rng.gen_bool(0.5),
            dsync: self.rng.gen_bool(0.2),
            ..OpenFlags::default()
        }
    }

    fn push_handle(&mut self, id: Id, file: File, flags: OpenFlags) {
        if self.handles.len() >= self.cfg.max_handles {
            self.handles.remove(0);
        }
        self.handles.push(WHandle {
            id,
            file,
            direct: flags.direct,
            dsync: flags.dsync || flags.sync,
            orphan: false,
        });
    }

    pub fn op_create(&mut self) {
        let paths = self.file_paths();
        let path = self.pick(&paths).unwrap();
        let parent = parent_of(&path).to_string();
        if parent != "/" && !self.h.ns.dirs.contains(&parent) {
            return self.op_dir();
        }
        let mut flags = self.random_flags();
        flags.create = true;
        let existing = self.h.ns.files.get(&path).copied();
        flags.truncate = existing.is_some() && self.rng.gen_bool(0.2);
        self.h.begin(format!("open({path}, {flags:?})"));
        let r = self.vol().open_file(&path, flags);
        let id = match existing {
            Some(id) => {
                if flags.truncate {
                    self.h.data_mut(id).clear();
                }
                id
            }
            None => self.h.new_file(&path),
        };
        if let Some(f) = self.finish("open", r) {
            self.push_handle(id, f, flags);
        }
    }

    /// A live handle of a random existing file, opening one if needed.
    /// `found`, or, when there is no handle to work on, a new file made
    /// instead (the op's turn is not lost) and `None`.
    fn or_create(&mut self, found: Option<usize>) -> Option<usize> {
        if found.is_none() && self.failed.is_none() {
            self.op_create();
        }
        found
    }

    fn handle_for_write(&mut self) -> Option<usize> {
        let live: Vec<usize> = (0..self.handles.len())
            .filter(|&i| !self.handles[i].orphan || self.rng.gen_bool(0.3))
            .collect();
        if !live.is_empty() && self.rng.gen_bool(0.8) {
            return self.pick(&live);
        }
        self.open_existing()
    }

    /// Opens a new handle on a random existing file (an op that changes
    /// nothing, but may fail under fault injection).
    fn open_existing(&mut self) -> Option<usize> {
        let files = self.existing_files();
        let path = self.pick(&files)?;
        let id = self.h.ns.files[&path];
        let flags = self.random_flags();
        self.h.begin(format!("open existing({path}, {flags:?})"));
        let r = self.vol().open_file(&path, flags);
        let f = self.finish("open existing", r)?;
        self.push_handle(id, f, flags);
        Some(self.handles.len() - 1)
    }

    /// Writes one block at every other block of a range of one file, on
    /// one handle: up to 32 writes, each an extent of its own (the blocks
    /// between stay holes, or keep their own extents).
    pub fn op_strided_write(&mut self) {
        let found = self.handle_for_write();
        let Some(hi) = self.or_create(found) else {
            return;
        };
        let lbs = self.lbs;
        let blocks = self.cfg.max_file / lbs;
        let writes = (blocks / 2).min(32);
        let first = self.rng.gen_range(0..=blocks - 2 * writes) * lbs;
        for k in 0..writes {
            if !self.write_range(hi, first + 2 * k * lbs, lbs) {
                return;
            }
        }
    }

    pub fn op_write(&mut self) {
        let found = self.handle_for_write();
        let Some(hi) = self.or_create(found) else {
            return;
        };
        let direct = self.handles[hi].direct;
        let lbs = self.lbs;
        // Direct handles mostly write whole device blocks; some writes of
        // every handle are byte-granular (edge read-modify-write).
        let (off, len) = if direct && self.rng.gen_bool(0.8) {
            let off = self.rng.gen_range(0..self.cfg.max_file / lbs) * lbs;
            let len = self.rng.gen_range(1..=self.cfg.max_write / lbs) * lbs;
            (off, len.min(self.cfg.max_file - off).max(lbs))
        } else {
            let off = self.rng.gen_range(0..self.cfg.max_file);
            let len = self.rng.gen_range(1..=self.cfg.max_write);
            (off, len.min(self.cfg.max_file - off).max(1))
        };
        self.write_range(hi, off, len);
    }

    /// One `pwrite` of `len` bytes at `off` through handle `hi`, recorded
    /// in the model. `false` when the workload cannot go on with that
    /// handle: it was dropped (its file is gone) or the write failed.
    fn write_range(&mut self, hi: usize, off: u64, len: u64) -> bool {
        let (id, direct, dsync, orphan) = {
            let h = &self.handles[hi];
            (h.id, h.direct, h.dsync, h.orphan)
        };
        let wid = self.new_wid();
        let data = tagged(wid, off, len as usize);
        self.h.begin(format!(
            "write(#{id}{}, {} {}[{off}, {}) w{wid})",
            if orphan { " orphan" } else { "" },
            if direct { "direct" } else { "buffered" },
            if dsync { "dsync " } else { "" },
            off + len
        ));
        let r = self.handles[hi].file.pwrite(&data, off);
        if orphan
            && r.as_ref()
                .is_err_and(|e| matches!(e.root(), Error::Stale { .. }))
        {
            self.h.end();
            self.handles.remove(hi);
            return false;
        }
        let r = match r {
            Ok(n) if n as u64 != len => {
                panic!("pwrite of {len} at {off} returned {n}: short write with space free")
            }
            r => r,
        };
        {
            let d = self.h.data_mut(id);
            let end = (off + len) as usize;
            if d.len() < end {
                d.resize(end, 0);
            }
            d[off as usize..end].copy_from_slice(&data);
        }
        if dsync {
            self.h.mark_dsync(id, off, off + len);
        }
        self.finish("pwrite", r).is_some()
    }

    /// A batch of asynchronous reads and writes on one handle through an
    /// I/O queue, submitted together and all reaped before the op ends. On
    /// a device whose queue completes out of order, the writes land in any
    /// order: they cover disjoint device blocks, so the model stays exact,
    /// and a cut in the middle leaves any subset of them (checked byte by
    /// byte). Reads cover bytes inside the size the file had before the
    /// batch, which no write of the batch touches, and must match the model.
    pub fn op_async(&mut self) {
        let found = self.live_file_handle();
        let Some(hi) = self.or_create(found) else {
            return;
        };
        let (id, direct, dsync) = {
            let h = &self.handles[hi];
            (h.id, h.direct, h.dsync)
        };
        let lbs = self.lbs;
        let size_before = self.h.data(id).len() as u64;
        // Disjoint device-block ranges: [start, end) rounded out to lbs.
        let mut taken: Vec<(u64, u64)> = Vec::new();
        let mut reqs: Vec<(bool, u64, u64)> = Vec::new(); // (write, off, len)
        for _ in 0..self.rng.gen_range(1..=6) {
            let write = size_before < lbs || self.rng.gen_bool(0.75);
            let (off, len) = if write {
                if self.rng.gen_bool(0.8) {
                    let off = self.rng.gen_range(0..self.cfg.max_file / lbs) * lbs;
                    let len = self.rng.gen_range(1..=(self.cfg.max_write / lbs).min(8)) * lbs;
                    (off, len.min(self.cfg.max_file - off).max(lbs))
                } else {
                    let off = self.rng.gen_range(0..self.cfg.max_file);
                    let len = self.rng.gen_range(1..=4096u64);
                    (off, len.min(self.cfg.max_file - off).max(1))
                }
            } else {
                let off = self.rng.gen_range(0..size_before);
                let len = self.rng.gen_range(1..=(size_before - off).min(16 * 1024));
                (off, len)
            };
            let (lo, hi_) = (off / lbs * lbs, (off + len).div_ceil(lbs) * lbs);
            if taken.iter().any(|&(a, b)| a < hi_ && lo < b) {
                continue;
            }
            taken.push((lo, hi_));
            reqs.push((write, off, len));
        }
        let mut desc = Vec::new();
        let mut datas = Vec::new();
        for &(write, off, len) in &reqs {
            if write {
                let wid = self.new_wid();
                datas.push(Some(tagged(wid, off, len as usize)));
                desc.push(format!("w[{off}, {}) w{wid}", off + len));
            } else {
                datas.push(None);
                desc.push(format!("r[{off}, {})", off + len));
            }
        }
        self.h.begin(format!(
            "async(#{id} {}{}: {})",
            if direct { "direct" } else { "buffered" },
            if dsync { " dsync" } else { "" },
            desc.join(" ")
        ));
        let expected: Vec<Vec<u8>> = reqs
            .iter()
            .map(|&(_, off, len)| {
                let d = self.h.data(id);
                let end = ((off + len) as usize).min(d.len());
                d[(off as usize).min(end)..end].to_vec()
            })
            .collect();
        let r = self.run_async_batch(hi, &reqs, &datas);
        // The model: every write of the batch applied (they are disjoint).
        for (&(write, off, len), data) in reqs.iter().zip(&datas) {
            if !write {
                continue;
            }
            let d = self.h.data_mut(id);
            let end = (off + len) as usize;
            if d.len() < end {
                d.resize(end, 0);
            }
            d[off as usize..end].copy_from_slice(data.as_ref().unwrap());
            if dsync {
                self.h.mark_dsync(id, off, off + len);
            }
        }
        match r {
            Ok(reads) => {
                for (i, got) in reads {
                    let (_, off, _) = reqs[i];
                    assert!(
                        got == expected[i],
                        "async read at {off} of #{id}: {} bytes differ from the model ({} vs {} bytes)",
                        got.iter().zip(&expected[i]).filter(|(a, b)| a != b).count(),
                        got.len(),
                        expected[i].len()
                    );
                }
                self.finish("async batch", Ok(()));
            }
            Err(e) => {
                self.finish::<()>("async batch", Err(e));
            }
        }
    }

    /// Submits `reqs` on handle `hi` through a new queue and reaps them
    /// all; returns each read's bytes (by request index) or the first error.
    fn run_async_batch(
        &mut self,
        hi: usize,
        reqs: &[(bool, u64, u64)],
        datas: &[Option<Vec<u8>>],
    ) -> R<Vec<(usize, Vec<u8>)>> {
        let vol = self.vol.as_ref().expect("mounted").clone();
        let file = &self.handles[hi].file;
        let mut q = vol.io_queue(self.rng.gen_range(1..=8))?;
        let mut first_error = None;
        for (i, (&(write, off, len), data)) in reqs.iter().zip(datas).enumerate() {
            let mut buf = blockdev::AlignedBuf::new(len as usize, 4096).expect("buffer");
            let submitted = if write {
                buf.copy_from_slice(data.as_ref().unwrap());
                q.submit_write(file, off, buf, i as u64)
            } else {
                q.submit_read(file, off, buf, i as u64)
            };
            if let Err(refused) = submitted {
                first_error.get_or_insert(refused.1);
            }
        }
        let mut done = Vec::new();
        while q.in_flight() > 0 {
            if let Err(e) = q.reap(1, &mut done) {
                first_error.get_or_insert(e);
                break;
            }
        }
        let mut reads = Vec::new();
        for c in done {
            let (write, _, len) = reqs[c.token as usize];
            match c.result {
                Ok(n) if write => assert_eq!(n as u64, len, "short async write"),
                Ok(n) => reads.push((c.token as usize, c.buf[..n].to_vec())),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(reads),
        }
    }

    fn live_file_handle(&mut self) -> Option<usize> {
        let live: Vec<usize> = (0..self.handles.len())
            .filter(|&i| !self.handles[i].orphan)
            .collect();
        if !live.is_empty() && self.rng.gen_bool(0.7) {
            return self.pick(&live);
        }
        self.open_existing()
    }

    pub fn op_truncate(&mut self) {
        let found = self.live_file_handle();
        let Some(hi) = self.or_create(found) else {
            return;
        };
        let id = self.handles[hi].id;
        let size = match self.rng.gen_range(0..4) {
            0 => 0,
            1 => self.rng.gen_range(0..=self.cfg.max_file / 4096) * 4096,
            _ => self.rng.gen_range(0..=self.cfg.max_file),
        };
        self.h.begin(format!("truncate(#{id}, {size})"));
        let r = self.handles[hi].file.truncate(size);
        self.h.data_mut(id).resize(size as usize, 0);
        self.finish("truncate", r);
    }

    pub fn op_fallocate(&mut self) {
        let found = self.live_file_handle();
        let Some(hi) = self.or_create(found) else {
            return;
        };
        let id = self.handles[hi].id;
        let off = self.rng.gen_range(0..self.cfg.max_file);
        let len = self
            .rng
            .gen_range(1..=(self.cfg.max_file - off).min(32 * 1024));
        let keep = self.rng.gen_bool(0.4);
        self.h
            .begin(format!("fallocate(#{id}, {off}, {len}, keep={keep})"));
        let r = self.handles[hi].file.fallocate(off, len, keep);
        if !keep {
            let d = self.h.data_mut(id);
            if (d.len() as u64) < off + len {
                d.resize((off + len) as usize, 0);
            }
        }
        self.finish("fallocate", r);
    }

    pub fn op_punch(&mut self) {
        let found = self.live_file_handle();
        let Some(hi) = self.or_create(found) else {
            return;
        };
        let id = self.handles[hi].id;
        let off = self.rng.gen_range(0..self.cfg.max_file);
        let len = self
            .rng
            .gen_range(1..=(self.cfg.max_file - off).min(32 * 1024));
        self.h.begin(format!("punch(#{id}, {off}, {len})"));
        let r = self.handles[hi].file.punch_hole(off, len);
        {
            let d = self.h.data_mut(id);
            let end = ((off + len) as usize).min(d.len());
            if (off as usize) < end {
                d[off as usize..end].fill(0);
            }
        }
        self.finish("punch_hole", r);
    }

    pub fn op_rename(&mut self) {
        let files = self.existing_files();
        let Some(from) = self.pick(&files) else {
            return self.op_create();
        };
        let targets: Vec<String> = self
            .file_paths()
            .into_iter()
            .filter(|p| {
                let parent = parent_of(p);
                p != &from && (parent == "/" || self.h.ns.dirs.contains(parent))
            })
            .collect();
        let Some(to) = self.pick(&targets) else {
            return;
        };
        self.h.begin(format!("rename({from}, {to})"));
        let r = self.vol().rename(&from, &to);
        let ns = self.h.ns_mut();
        let id = ns.files[&from];
        // Two names of one inode: POSIX rename does nothing.
        if ns.files.get(&to) != Some(&id) {
            ns.files.remove(&from);
            if let Some(old) = ns.files.insert(to.clone(), id) {
                self.mark_orphans(old);
            }
        }
        self.finish("rename", r);
    }

    pub fn op_unlink(&mut self) {
        let files = self.existing_files();
        let Some(path) = self.pick(&files) else {
            return self.op_create();
        };
        self.h.begin(format!("unlink({path})"));
        let r = self.vol().unlink(&path);
        let id = self.h.ns_mut().files.remove(&path).unwrap();
        self.mark_orphans(id);
        self.finish("unlink", r);
    }

    /// A change of what format version 2 added: a hard link, a symlink
    /// created or removed, chmod, chown, or a `user.` xattr set or removed.
    pub fn op_meta(&mut self) {
        let files = self.existing_files();
        let choice = self.rng.gen_range(0..6);
        if files.is_empty() || choice == 0 {
            let path = self.pick(SYMLINK_PATHS).unwrap().to_string();
            if self.h.ns.symlinks.contains_key(&path) {
                self.h.begin(format!("unlink symlink({path})"));
                let r = self.vol().unlink(&path);
                self.h.ns_mut().symlinks.remove(&path);
                self.finish("unlink symlink", r);
            } else {
                let target = format!(
                    "t{}/{}",
                    self.rng.gen_range(0..1000),
                    "x".repeat(self.rng.gen_range(0..200))
                );
                self.h.begin(format!("symlink({target:.20}, {path})"));
                let r = self.vol().symlink(&target, &path);
                self.h.ns_mut().symlinks.insert(path, target);
                self.finish("symlink", r);
            }
            return;
        }
        let path = self.pick(&files).unwrap();
        let id = self.h.ns.files[&path];
        let ino = match self.vol().ino_of(&path) {
            Ok(ino) => ino,
            Err(e) => panic!("ino_of({path}) of a file the model has: {e}"),
        };
        match choice {
            1 => {
                let targets: Vec<String> = self
                    .file_paths()
                    .into_iter()
                    .filter(|p| {
                        let parent = parent_of(p);
                        !self.h.ns.files.contains_key(p)
                            && (parent == "/" || self.h.ns.dirs.contains(parent))
                    })
                    .collect();
                let Some(to) = self.pick(&targets) else {
                    return;
                };
                self.h.begin(format!("link({path}, {to})"));
                let r = self.vol().link(&path, &to);
                self.h.ns_mut().files.insert(to, id);
                self.finish("link", r);
            }
            2 | 3 => {
                let chown = choice == 3;
                let mode = self.rng.gen_range(0..=0o7777u32);
                let owner = (self.rng.gen_range(0..5u32), self.rng.gen_range(0..5u32));
                let change = if chown {
                    SetAttr {
                        uid: Some(owner.0),
                        gid: Some(owner.1),
                        ..SetAttr::default()
                    }
                } else {
                    SetAttr {
                        mode: Some(mode),
                        ..SetAttr::default()
                    }
                };
                self.h.begin(format!("setattr({path} #{id}, {change:?})"));
                let r = self.vol().set_attr(ino, &change);
                let a = self.h.ns_mut().attrs.entry(id).or_default();
                if chown {
                    a.owner = Some(owner);
                } else {
                    a.mode = mode;
                }
                self.finish("setattr", r);
            }
            _ => {
                let name = self.pick(XATTR_NAMES).unwrap().to_string();
                let has = self
                    .h
                    .ns
                    .attrs
                    .get(&id)
                    .is_some_and(|a| a.xattrs.contains_key(&name));
                if has && self.rng.gen_bool(0.4) {
                    self.h.begin(format!("removexattr({path} #{id}, {name})"));
                    let r = self.vol().remove_xattr(ino, &name);
                    self.h
                        .ns_mut()
                        .attrs
                        .entry(id)
                        .or_default()
                        .xattrs
                        .remove(&name);
                    self.finish("removexattr", r);
                } else {
                    let wid = self.new_wid();
                    let value = tagged(wid, 0, self.rng.gen_range(0..300));
                    self.h.begin(format!(
                        "setxattr({path} #{id}, {name}, {} bytes)",
                        value.len()
                    ));
                    let r = self.vol().set_xattr(ino, &name, &value, XattrSet::Any);
                    self.h
                        .ns_mut()
                        .attrs
                        .entry(id)
                        .or_default()
                        .xattrs
                        .insert(name, value);
                    self.finish("setxattr", r);
                }
            }
        }
    }

    pub fn op_dir(&mut self) {
        let d = self.pick(DIRS).unwrap().to_string();
        if !self.h.ns.dirs.contains(&d) {
            self.h.begin(format!("mkdir({d})"));
            let r = self.vol().mkdir(&d);
            self.h.ns_mut().dirs.insert(d);
            self.finish("mkdir", r);
        } else {
            let prefix = format!("{d}/");
            let empty = !self.h.ns.files.keys().any(|p| p.starts_with(&prefix));
            if !empty {
                return;
            }
            self.h.begin(format!("rmdir({d})"));
            let r = self.vol().rmdir(&d);
            self.h.ns_mut().dirs.remove(&d);
            self.finish("rmdir", r);
        }
    }

    pub fn op_fsync(&mut self) {
        if self.handles.is_empty() {
            return self.op_sync();
        }
        let hi = self.rng.gen_range(0..self.handles.len());
        let data_only = self.rng.gen_bool(0.5);
        let id = self.handles[hi].id;
        self.h.begin(format!(
            "{}(#{id}{})",
            if data_only { "fdatasync" } else { "fsync" },
            if self.handles[hi].orphan {
                " orphan"
            } else {
                ""
            }
        ));
        let r = if data_only {
            self.handles[hi].file.fdatasync()
        } else {
            self.handles[hi].file.fsync()
        };
        if self.handles[hi].orphan
            && r.as_ref()
                .is_err_and(|e| matches!(e.root(), Error::Stale { .. }))
        {
            self.h.end();
            self.handles.remove(hi);
            return;
        }
        if r.is_ok() {
            // This file's data and every metadata change: other files'
            // cached data stays where it is.
            self.h.mark_file_durable(id);
        }
        self.finish("fsync", r);
    }

    pub fn op_sync(&mut self) {
        self.h.begin("sync");
        let r = self.vol().sync();
        if r.is_ok() {
            self.h.mark_durable();
        }
        self.finish("sync", r);
    }

    pub fn op_checkpoint(&mut self) {
        self.h.begin("checkpoint");
        let r = self.vol().checkpoint();
        if r.is_ok() {
            self.h.mark_durable();
        }
        self.finish("checkpoint", r);
    }

    pub fn op_close(&mut self) {
        if self.handles.is_empty() {
            return;
        }
        let hi = self.rng.gen_range(0..self.handles.len());
        let h = self.handles.remove(hi);
        // Closing the last handle of an orphan frees its space: a metadata
        // change of its own, so it is an op (a cut may land in it).
        self.h.begin(format!(
            "close(#{}{})",
            h.id,
            if h.orphan { " orphan" } else { "" }
        ));
        drop(h);
        self.h.end();
    }

    /// Remounts: clean unmount, sync + drop, or (if allowed) a plain drop, a
    /// crash without power loss, after which the model adopts what recovery
    /// found (checked against the window first).
    pub fn op_remount(&mut self) {
        let how = self.rng.gen_range(0..3);
        let how = if how == 2 && !self.cfg.crash_remounts {
            1
        } else {
            how
        };
        let name = ["remount(unmount)", "remount(sync+drop)", "remount(drop)"][how];
        self.h.begin(name);
        self.handles.clear();
        let vol = self.vol.take().unwrap();
        let r = match how {
            0 => vol.unmount(),
            1 => {
                let r = vol.sync();
                drop(vol);
                r
            }
            _ => {
                drop(vol);
                Ok(())
            }
        };
        if let Err(e) = r {
            self.h.end_failed();
            self.failed = Some(format!("{name}: {e}"));
            return;
        }
        if how < 2 {
            self.h.mark_durable();
        }
        let w_before = self.h.progress.window();
        match crate::common::open_replayable(self.dev.clone()) {
            Ok(v) => self.vol = Some(v),
            Err(e) => {
                self.h.end_failed();
                self.failed = Some(format!("reopen after {name}: {e}"));
                return;
            }
        }
        if how == 2 {
            // What recovery found must be a state of the window; adopt it.
            let st = match read_volume(self.vol(), u64::MAX) {
                Ok(st) => st,
                Err(e) => {
                    self.h.end_failed();
                    self.failed = Some(format!("reading the volume after {name}: {e}"));
                    return;
                }
            };
            let w = Window {
                lo: w_before.lo,
                completed: w_before.completed,
                hi: w_before.completed,
            };
            let ns = self
                .h
                .check(&st, w)
                .unwrap_or_else(|e| panic!("after {name} (crash without power loss): {e}"));
            self.adopt(&ns, &st);
        } else if self.cfg.live_check > 0.0 {
            self.compare_all("after a synced remount");
        }
        self.h.end();
    }

    fn adopt(&mut self, ns: &Namespace, st: &VolState) {
        *self.h.ns_mut() = ns.clone();
        for (path, &id) in &ns.files {
            *self.h.data_mut(id) = st.files[path].data.clone();
        }
    }

    /// Compares one random file (read through a fresh handle) with the model.
    pub fn live_check_one(&mut self) {
        let files = self.existing_files();
        let Some(path) = self.pick(&files) else {
            return;
        };
        let id = self.h.ns.files[&path];
        let fd = super::volstate::read_file(self.vol(), &path, u64::MAX)
            .unwrap_or_else(|e| panic!("live check: {e}"));
        let want = self.h.data(id);
        if fd.data != want {
            let at = super::first_diff(&fd.data, want).unwrap_or(0);
            panic!(
                "live check: {path} (#{id}) differs from the model at {at} (size {} want {}): got {} (from {}) want {}; last ops {:?}",
                fd.size,
                want.len(),
                super::excerpt(&fd.data, at),
                super::history::attribute(&fd.data, at, self.next_wid),
                super::excerpt(want, at),
                &self.h.op_names[self.h.op_names.len().saturating_sub(super::env_u64("IOMAPFS_LOG_TAIL", 8) as usize)..]
            );
        }
    }

    /// Compares the whole volume with the model.
    pub fn compare_all(&self, ctx: &str) {
        let st = read_volume(self.vol(), u64::MAX).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        let ns = &self.h.ns;
        if !ns.same_names(&st) {
            panic!(
                "{ctx}: namespace differs: volume dirs {:?} files {:?}; model {}",
                st.dirs,
                st.files.keys().collect::<Vec<_>>(),
                ns.describe()
            );
        }
        for (path, &id) in &ns.files {
            let want = self.h.data(id);
            let got = &st.files[path].data;
            if got != want {
                let at = super::first_diff(got, want).unwrap_or(0);
                panic!(
                    "{ctx}: {path} (#{id}) differs at {at} (size {} want {}): got {} want {}",
                    got.len(),
                    want.len(),
                    super::excerpt(got, at),
                    super::excerpt(want, at)
                );
            }
        }
    }
}
