//! Randomized differential test: random operation sequences run against a
//! volume and against a plain model (paths -> bytes, a set of directories);
//! every answer must agree.
//!
//! Covered: create/open (direct, buffered, dsync, read-only, exclusive,
//! truncate), pwrite (aligned; unaligned on buffered handles; unaligned on
//! direct handles must be EINVAL), pread (across EOF, holes, unwritten
//! space), truncate up and down at any size, fallocate with and without
//! keep_size, punch_hole at any offset, rename (moves, replaces, directories,
//! errors), unlink (also of open files: orphans), mkdir/rmdir, readdir, stat,
//! fiemap, fsync/fdatasync/sync/checkpoint, remounts (clean unmount, and
//! sync + drop with journal replay), and filling the device (ENOSPC must
//! change nothing). Each case ends with a clean fsck, an accounting check
//! (space used = space the files hold) and a final remount comparison.
//!
//! Env: `IOMAPFS_MODEL_TOTAL_OPS` (default 1,000,000 operations per run,
//! split over four tests that the harness runs in parallel),
//! `IOMAPFS_MODEL_CASES` (run this many cases instead), `IOMAPFS_MODEL_OPS`
//! (max ops per case, default 150), `IOMAPFS_TEST_SEED`,
//! `IOMAPFS_TEST_BASE_SEED`.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use blockdev::memory::MemDevice;
use blockdev::BlockDevice;
use common::dev::{dynd, fsck_clean, Geometry, MIB};
use common::volstate::{join, parent_of};
use common::{env_u64, excerpt, first_diff, run_case, Rng, SeedableRng, Seeds, SmallRng, Stats};
use iomapfs_fs::{Error, FiemapKind, File, FileKind, OpenFlags, Volume};

const DEV_SIZE: u64 = 8 * MIB;
const MAX_OFF: u64 = 256 * 1024;

const DIR_POOL: &[&str] = &["/d0", "/d1", "/d0/e"];
const NAME_POOL: &[&str] = &["a", "b", "c"];

type Id = u32;

const SYMLINK_POOL: &[&str] = &["/l0", "/l1"];
const XATTR_POOL: &[&str] = &["user.a", "user.b", "user.c"];

#[derive(Clone, Debug, Default)]
struct Model {
    dirs: BTreeSet<String>,
    /// Path -> file; two paths of one id are hard links.
    files: BTreeMap<String, Id>,
    data: HashMap<Id, Vec<u8>>,
    /// Files whose attributes changed from the defaults.
    attrs: HashMap<Id, Attrs>,
    /// Path -> target; only at [`SYMLINK_POOL`] names, which no other op
    /// uses, so that the path ops' expectations stay as they are.
    symlinks: BTreeMap<String, String>,
    next: Id,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Attrs {
    mode: u32,
    uid: u32,
    gid: u32,
    xattrs: BTreeMap<String, Vec<u8>>,
}

impl Default for Attrs {
    /// What `open(create)` gives: 0644, the process's user and group.
    fn default() -> Self {
        // SAFETY: geteuid and getegid cannot fail and touch no memory.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        Attrs {
            mode: 0o644,
            uid,
            gid,
            xattrs: BTreeMap::new(),
        }
    }
}

impl Model {
    fn is_dir(&self, p: &str) -> bool {
        p == "/" || self.dirs.contains(p)
    }
    fn exists(&self, p: &str) -> bool {
        self.is_dir(p) || self.files.contains_key(p)
    }
    fn names_of(&self, id: Id) -> u32 {
        self.files.values().filter(|&&v| v == id).count() as u32
    }
    fn attrs(&self, id: Id) -> Attrs {
        self.attrs.get(&id).cloned().unwrap_or_default()
    }
    fn children(&self, dir: &str) -> BTreeMap<String, FileKind> {
        let mut out = BTreeMap::new();
        for l in self.symlinks.keys() {
            if parent_of(l) == dir {
                out.insert(l.rsplit('/').next().unwrap().to_string(), FileKind::Symlink);
            }
        }
        for d in &self.dirs {
            if parent_of(d) == dir {
                out.insert(
                    d.rsplit('/').next().unwrap().to_string(),
                    FileKind::Directory,
                );
            }
        }
        for f in self.files.keys() {
            if parent_of(f) == dir {
                out.insert(f.rsplit('/').next().unwrap().to_string(), FileKind::Regular);
            }
        }
        out
    }
}

struct H {
    id: Id,
    file: File,
    flags: OpenFlags,
    orphan: bool,
}

struct Case {
    /// Bytes holding no file data, as of the last `free_bytes` (see
    /// `check_nospace`).
    unused_before: std::cell::Cell<u64>,
    seed: u64,
    rng: SmallRng,
    mem: Arc<MemDevice>,
    dev: Arc<dyn BlockDevice>,
    vol: Option<Volume>,
    m: Model,
    handles: Vec<H>,
    log: Vec<String>,
    bs: u64,
    lbs: u64,
    geometry: String,
}

fn gen_data(rng: &mut SmallRng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    match rng.gen_range(0..6) {
        0 => {} // zeros are data too
        1 => v.fill(rng.gen_range(1..=255)),
        2 | 3 => rng.fill(&mut v[..]),
        _ => {
            let tag = common::history::tag_of(rng.gen());
            for c in v.chunks_mut(8) {
                c.copy_from_slice(&tag[..c.len()]);
            }
        }
    }
    v
}

/// The name the model uses for an xattr error.
fn errno_name(e: &Error) -> &'static str {
    match e.root() {
        Error::Exists { .. } => "Exists",
        Error::NoXattr { .. } => "NoXattr",
        _ => "other",
    }
}

impl Case {
    fn new(seed: u64) -> Case {
        let mut rng = SmallRng::seed_from_u64(seed);
        let fua = rng.gen_bool(0.5);
        let geo = if rng.gen_bool(0.5) {
            Geometry::default_4k()
        } else {
            Geometry::random(&mut rng)
        };
        let mem = geo.formatted_device(DEV_SIZE, fua, rng.gen());
        let dev = dynd(&mem);
        let vol = common::open_replayable(dev.clone()).expect("open after format");
        let bs = u64::from(vol.statfs().block_size);
        assert_eq!(bs, u64::from(geo.opts.block_size));
        Case {
            unused_before: std::cell::Cell::new(0),
            seed,
            rng,
            mem,
            dev,
            vol: Some(vol),
            m: Model::default(),
            handles: Vec::new(),
            log: Vec::new(),
            geometry: format!("{} fua={fua}", geo.describe()),
            bs,
            lbs: u64::from(geo.lbs),
        }
    }

    fn vol(&self) -> &Volume {
        self.vol.as_ref().unwrap()
    }

    fn ctx(&self) -> String {
        let keep = env_u64("IOMAPFS_LOG_TAIL", 12) as usize;
        let tail = &self.log[self.log.len().saturating_sub(keep)..];
        format!(
            "seed={} ({}) op #{}; last ops:\n    {}",
            self.seed,
            self.geometry,
            self.log.len(),
            tail.join("\n    ")
        )
    }

    fn fail(&self, msg: String) -> ! {
        panic!("{msg}\n  {}", self.ctx())
    }

    fn note(&mut self, s: String) {
        self.log.push(s);
    }

    /// Appends an operation's outcome to its log line.
    fn note_result<T: std::fmt::Debug>(&mut self, r: &Result<T, Error>) {
        let o = match r {
            Ok(v) => format!(" -> Ok({v:?})"),
            Err(e) => format!(" -> Err({e})"),
        };
        if let Some(l) = self.log.last_mut() {
            l.push_str(&o);
        }
    }

    fn pick<T: Clone>(&mut self, v: &[T]) -> T {
        v[self.rng.gen_range(0..v.len())].clone()
    }

    fn rand_file_path(&mut self) -> String {
        match self.rng.gen_range(0..10) {
            0 => "/fill".into(),
            1 => {
                let d = self.pick(DIR_POOL);
                let n = self.pick(NAME_POOL);
                // Sometimes through a file: "/a/x" (NotDir) or a missing dir.
                if self.rng.gen_bool(0.5) {
                    format!("/{n}/x")
                } else {
                    format!("{d}/zz/{n}")
                }
            }
            2..=4 => {
                let d = self.pick(DIR_POOL);
                let n = self.pick(NAME_POOL);
                join(d, n)
            }
            _ => {
                let n = self.pick(NAME_POOL);
                join("/", n)
            }
        }
    }

    fn rand_any_path(&mut self) -> String {
        if self.rng.gen_bool(0.3) {
            self.pick(DIR_POOL).to_string()
        } else {
            self.rand_file_path()
        }
    }

    /// Expected error for resolving `path`'s parent, if any.
    fn parent_error(&self, path: &str) -> Option<&'static str> {
        let parent = parent_of(path);
        // Walk components: a file on the way gives NotDir, a missing one NotFound.
        let mut cur = String::new();
        for comp in parent.split('/').filter(|c| !c.is_empty()) {
            cur = format!("{cur}/{comp}");
            if self.m.files.contains_key(&cur) {
                return Some("NotDir");
            }
            if !self.m.dirs.contains(&cur) {
                return Some("NotFound");
            }
        }
        None
    }

    fn check_err(&self, what: &str, r: &Error, want: &[&str]) {
        let name = match r.root() {
            Error::NotFound { .. } => "NotFound",
            Error::Exists { .. } => "Exists",
            Error::NotDir { .. } => "NotDir",
            Error::IsDir { .. } => "IsDir",
            Error::NotEmpty { .. } => "NotEmpty",
            Error::InvalidArgument { .. } => "InvalidArgument",
            Error::NoSpace { .. } => "NoSpace",
            Error::Stale { .. } => "Stale",
            Error::NotPermitted { .. } => "NotPermitted",
            Error::Iomap(iomap::IomapError::Unaligned { .. }) => "InvalidArgument",
            _ => "other",
        };
        if !want.contains(&name) && !want.contains(&"any") {
            self.fail(format!(
                "{what}: got error {name} ({r}), want one of {want:?}"
            ));
        }
        if r.to_string().is_empty() {
            self.fail(format!("{what}: error with an empty message"));
        }
    }

    fn free_bytes(&self) -> u64 {
        let sf = self.vol().statfs();
        self.unused_before.set(sf.free_bytes + sf.metadata_bytes);
        sf.free_bytes
    }

    /// ENOSPC is only acceptable when space is really short.
    fn check_nospace(&self, what: &str, e: &Error, needed: u64, free_before: u64) {
        if !matches!(e.root(), Error::NoSpace { .. }) {
            return;
        }
        let slack = 2 * MIB;
        if free_before > needed + slack {
            self.fail(format!(
                "{what}: ENOSPC ({e}) with {free_before} bytes free for a {needed}-byte request"
            ));
        }
        // A failed call takes no space for data. Free plus metadata bytes,
        // not free bytes alone: the checkpoint a call short of space runs
        // (to release busy space) moves bytes between the two when it
        // writes a base's extent pages and frees the old ones.
        let before = self.unused_before.get();
        let sf = self.vol().statfs();
        let after = sf.free_bytes + sf.metadata_bytes;
        if after != before {
            self.fail(format!(
                "{what}: failed with ENOSPC but the bytes free or metadata changed {before} -> {after}"
            ));
        }
    }

    /// After a failed operation: the file (read through handle `hi`) and its
    /// size are exactly as the model says — a failed call changes nothing.
    fn verify_unchanged(&self, hi: usize, what: &str) {
        let h = &self.handles[hi];
        let want = &self.m.data[&h.id];
        let size = match h.file.stat() {
            Ok(st) => st.size,
            Err(e) => self.fail(format!("{what}: stat after the failure: {e}")),
        };
        if size != want.len() as u64 {
            self.fail(format!(
                "{what}: failed, but the size changed: {size}, want {}",
                want.len()
            ));
        }
        let lbs = self.lbs;
        let mut buf = vec![0u8; (size.div_ceil(lbs).max(1) * lbs) as usize];
        match h.file.pread(&mut buf, 0) {
            Ok(n) if n == want.len() && buf[..n] == want[..] => {}
            Ok(n) => {
                let at = first_diff(&buf[..n], want).unwrap_or(0);
                self.fail(format!(
                    "{what}: failed, but the file changed (read {n} of {}): at {at} got {} want {}",
                    want.len(),
                    excerpt(&buf[..n], at),
                    excerpt(want, at)
                ));
            }
            Err(e) => self.fail(format!("{what}: read after the failure: {e}")),
        }
    }

    fn push_handle(&mut self, id: Id, file: File, flags: OpenFlags) {
        if self.handles.len() >= 8 {
            let i = self.rng.gen_range(0..self.handles.len());
            self.handles.remove(i);
        }
        self.handles.push(H {
            id,
            file,
            flags,
            orphan: false,
        });
    }

    /// `id` lost a name: its handles become orphans with the last one.
    fn orphan(&mut self, id: Id) {
        if self.m.names_of(id) > 0 {
            return;
        }
        for h in &mut self.handles {
            if h.id == id {
                h.orphan = true;
            }
        }
        if !self.handles.iter().any(|h| h.id == id) {
            self.m.data.remove(&id);
        }
    }

    // ---- operations -------------------------------------------------------

    fn op_open(&mut self) {
        let path = if self.rng.gen_bool(0.1) {
            self.rand_any_path()
        } else {
            self.rand_file_path()
        };
        let create = self.rng.gen_bool(0.6);
        let exclusive = create && self.rng.gen_bool(0.2);
        let truncate = self.rng.gen_bool(0.1);
        let read_only = !create && !truncate && self.rng.gen_bool(0.2);
        let flags = OpenFlags {
            create,
            exclusive,
            truncate,
            direct: self.rng.gen_bool(0.5),
            dsync: self.rng.gen_bool(0.1),
            sync: self.rng.gen_bool(0.05),
            read_only,
        };
        self.note(format!("open({path}, {flags:?})"));
        let r = self.vol().open_file(&path, flags);
        let what = format!("open({path})");
        let perr = self.parent_error(&path);
        if self.m.is_dir(&path) {
            match r {
                Ok(_) => self.fail(format!("{what}: opened a directory as a file")),
                Err(e) => self.check_err(&what, &e, &["IsDir", "Exists"]),
            }
        } else if let Some(pe) = perr {
            match r {
                Ok(_) => self.fail(format!("{what}: succeeded, want {pe}")),
                Err(e) => self.check_err(&what, &e, &[pe]),
            }
        } else if let Some(&id) = self.m.files.get(&path) {
            match r {
                Ok(f) if !exclusive => {
                    if truncate {
                        self.m.data.get_mut(&id).unwrap().clear();
                    }
                    if f.flags().direct != flags.direct {
                        self.fail(format!("{what}: flags() {:?} != {flags:?}", f.flags()));
                    }
                    self.push_handle(id, f, flags);
                }
                Ok(_) => self.fail(format!(
                    "{what}: exclusive create of an existing file succeeded"
                )),
                Err(e) if exclusive => self.check_err(&what, &e, &["Exists"]),
                Err(e) => self.fail(format!("{what}: {e}")),
            }
        } else {
            match r {
                Ok(f) if create => {
                    self.m.next += 1;
                    let id = self.m.next;
                    self.m.files.insert(path.clone(), id);
                    self.m.data.insert(id, Vec::new());
                    self.push_handle(id, f, flags);
                }
                Ok(_) => self.fail(format!("{what}: opened a missing file without create")),
                Err(e) if create => {
                    let free = self.free_bytes();
                    self.check_err(&what, &e, &["NoSpace"]);
                    self.check_nospace(&what, &e, 0, free);
                }
                Err(e) => self.check_err(&what, &e, &["NotFound"]),
            }
        }
    }

    /// A random handle, opening one on an existing file if there is none.
    fn some_handle(&mut self) -> Option<usize> {
        if self.handles.is_empty() || self.rng.gen_bool(0.1) {
            let files: Vec<String> = self.m.files.keys().cloned().collect();
            if files.is_empty() {
                return None;
            }
            let path = self.pick(&files);
            let id = self.m.files[&path];
            let flags = OpenFlags {
                direct: self.rng.gen_bool(0.5),
                ..OpenFlags::default()
            };
            let f = match self.vol().open_file(&path, flags) {
                Ok(f) => f,
                Err(e) => self.fail(format!("open existing {path}: {e}")),
            };
            self.push_handle(id, f, flags);
            return Some(self.handles.len() - 1);
        }
        Some(self.rng.gen_range(0..self.handles.len()))
    }

    /// Handles a `Stale` answer on an orphan: allowed, and the handle is dead.
    fn stale_orphan(&mut self, hi: usize, e: &Error) -> bool {
        if self.handles[hi].orphan && matches!(e.root(), Error::Stale { .. }) {
            self.handles.remove(hi);
            return true;
        }
        false
    }

    fn op_write(&mut self) {
        let Some(hi) = self.some_handle() else { return };
        let (id, flags, orphan) = {
            let h = &self.handles[hi];
            (h.id, h.flags, h.orphan)
        };
        let lbs = self.lbs;
        let big = self.rng.gen_bool(0.05);
        let max_len = if big { 1024 * 1024 } else { 64 * 1024 };
        // Direct handles mostly write whole device blocks (the fast paths);
        // every handle also writes at any byte offset and length.
        let (off, len) = if flags.direct && self.rng.gen_bool(0.7) {
            let off = self.rng.gen_range(0..MAX_OFF / lbs) * lbs;
            let len = self.rng.gen_range(1..=max_len / lbs) * lbs;
            (off, len)
        } else {
            let off = match self.rng.gen_range(0..4) {
                0 => self.m.data.get(&id).map(|d| d.len() as u64).unwrap_or(0), // append
                1 => self.rng.gen_range(0..MAX_OFF / self.bs) * self.bs + self.rng.gen_range(0..3),
                _ => self.rng.gen_range(0..MAX_OFF),
            };
            let len = match self.rng.gen_range(0..4) {
                0 => self.rng.gen_range(1..16),
                1 => self.bs - off % self.bs, // up to a block boundary
                _ => self.rng.gen_range(1..=max_len),
            };
            (off, len)
        };
        let data = gen_data(&mut self.rng, len as usize);
        let what = format!(
            "pwrite(#{id}{}, {}{}{}, [{off}, {}))",
            if orphan { " orphan" } else { "" },
            if flags.direct { "direct" } else { "buffered" },
            if flags.dsync || flags.sync {
                " dsync"
            } else {
                ""
            },
            if flags.read_only { " read-only" } else { "" },
            off + len
        );
        self.note(what.clone());
        let free = self.free_bytes();
        let r = self.handles[hi].file.pwrite(&data, off);
        self.note_result(&r);
        let failed = r.is_err();
        let n_handles = self.handles.len();
        match r {
            Err(e) if self.stale_orphan(hi, &e) => {}
            Err(e) if flags.read_only => self.check_err(&what, &e, &["any"]),
            Ok(_) if flags.read_only => {
                self.fail(format!("{what}: write on a read-only handle succeeded"))
            }
            Ok(n) => {
                if n == 0 || n as u64 > len {
                    self.fail(format!("{what}: returned {n}"));
                }
                if (n as u64) < len && free > len + 2 * MIB {
                    self.fail(format!(
                        "{what}: short write {n} of {len} with {free} bytes free"
                    ));
                }
                let d = self.m.data.get_mut(&id).unwrap();
                let end = off as usize + n;
                if d.len() < end {
                    d.resize(end, 0);
                }
                d[off as usize..end].copy_from_slice(&data[..n]);
            }
            Err(e) => {
                self.check_err(&what, &e, &["NoSpace"]);
                self.check_nospace(&what, &e, len, free);
            }
        }
        if failed && self.handles.len() == n_handles {
            self.verify_unchanged(hi, &what);
        }
    }

    fn op_read(&mut self) {
        let Some(hi) = self.some_handle() else { return };
        let (id, flags, orphan) = {
            let h = &self.handles[hi];
            (h.id, h.flags, h.orphan)
        };
        let size = self.m.data.get(&id).map(|d| d.len() as u64).unwrap_or(0);
        let lbs = self.lbs;
        let (off, len) = if flags.direct && self.rng.gen_bool(0.7) {
            let hi_off = (size + 8192) / lbs + 1;
            (
                self.rng.gen_range(0..hi_off) * lbs,
                self.rng.gen_range(1..=128u64) * lbs,
            )
        } else {
            let off = match self.rng.gen_range(0..4) {
                0 => size.saturating_sub(self.rng.gen_range(0..100)),
                _ => self.rng.gen_range(0..=size + 5000),
            };
            let len = self.rng.gen_range(1..=70_000u64);
            (off, len)
        };
        let what = format!(
            "pread(#{id}{}, {}, [{off}, {}), size {size})",
            if orphan { " orphan" } else { "" },
            if flags.direct { "direct" } else { "buffered" },
            off + len
        );
        self.note(what.clone());
        let mut buf = vec![0xEEu8; len as usize];
        let r = self.handles[hi].file.pread(&mut buf, off);
        self.note_result(&r);
        match r {
            Err(e) if self.stale_orphan(hi, &e) => {}
            Err(e) => self.fail(format!("{what}: {e}")),
            Ok(n) => {
                let want_n = size.saturating_sub(off).min(len) as usize;
                if n != want_n {
                    self.fail(format!("{what}: returned {n}, want {want_n}"));
                }
                let d = &self.m.data[&id];
                let want = &d[off.min(size) as usize..off.min(size) as usize + n];
                if &buf[..n] != want {
                    let at = first_diff(&buf[..n], want).unwrap();
                    self.fail(format!(
                        "{what}: data differs at file offset {}: got {} want {}",
                        off as usize + at,
                        excerpt(&buf[..n], at),
                        excerpt(want, at)
                    ));
                }
            }
        }
    }

    fn writable_handle(&mut self) -> Option<usize> {
        let hi = self.some_handle()?;
        Some(hi)
    }

    fn op_truncate(&mut self) {
        let Some(hi) = self.writable_handle() else {
            return;
        };
        let (id, flags, orphan) = {
            let h = &self.handles[hi];
            (h.id, h.flags, h.orphan)
        };
        let cur = self.m.data.get(&id).map(|d| d.len() as u64).unwrap_or(0);
        let size = match self.rng.gen_range(0..6) {
            0 => 0,
            1 => cur.saturating_sub(self.rng.gen_range(1..5000)),
            2 => cur + self.rng.gen_range(1..5000),
            3 => self.rng.gen_range(0..MAX_OFF / self.bs) * self.bs,
            _ => self.rng.gen_range(0..MAX_OFF + 64 * 1024),
        };
        let what = format!(
            "truncate(#{id}{}, {cur} -> {size})",
            if orphan { " orphan" } else { "" }
        );
        self.note(what.clone());
        let free = self.free_bytes();
        let r = self.handles[hi].file.truncate(size);
        self.note_result(&r);
        let failed = r.is_err();
        let n_handles = self.handles.len();
        match r {
            Err(e) if self.stale_orphan(hi, &e) => {}
            Err(e) if flags.read_only => self.check_err(&what, &e, &["any"]),
            Ok(()) if flags.read_only => {
                self.fail(format!("{what}: truncate on a read-only handle succeeded"))
            }
            Ok(()) => self.m.data.get_mut(&id).unwrap().resize(size as usize, 0),
            Err(e) => {
                self.check_err(&what, &e, &["NoSpace"]);
                self.check_nospace(&what, &e, 0, free);
            }
        }
        if failed && self.handles.len() == n_handles {
            self.verify_unchanged(hi, &what);
        }
    }

    fn op_fallocate(&mut self, huge: bool) {
        let Some(hi) = self.writable_handle() else {
            return;
        };
        let (id, flags, orphan) = {
            let h = &self.handles[hi];
            (h.id, h.flags, h.orphan)
        };
        let free = self.free_bytes();
        let (off, len) = if huge {
            // Past everything allocated (data and keep_size allocations
            // stay below MAX_OFF + 128 KiB, or below EOF), so that it
            // really needs more than is free.
            let size = self.m.data.get(&id).map(|d| d.len() as u64).unwrap_or(0);
            (
                size.max(2 * MAX_OFF) + self.rng.gen_range(0..8192),
                // Past free + metadata bytes: the room kept for pending
                // writeback (metadata) becomes free once it is done, which
                // the fallocate's own flush may do first.
                self.unused_before.get() + self.rng.gen_range(64 * 1024..MIB),
            )
        } else {
            (
                self.rng.gen_range(0..MAX_OFF),
                self.rng.gen_range(1..=128 * 1024),
            )
        };
        let keep = self.rng.gen_bool(0.4);
        let what = format!(
            "fallocate(#{id}{}, {off}, {len}, keep_size={keep})",
            if orphan { " orphan" } else { "" }
        );
        self.note(what.clone());
        let r = self.handles[hi].file.fallocate(off, len, keep);
        self.note_result(&r);
        let failed = r.is_err();
        let n_handles = self.handles.len();
        match r {
            Err(e) if self.stale_orphan(hi, &e) => {}
            Err(e) if flags.read_only => self.check_err(&what, &e, &["any"]),
            Ok(()) if flags.read_only => {
                self.fail(format!("{what}: fallocate on a read-only handle succeeded"))
            }
            Ok(()) if huge => self.fail(format!("{what}: succeeded with only {free} bytes free")),
            Ok(()) => {
                if !keep {
                    let d = self.m.data.get_mut(&id).unwrap();
                    if (d.len() as u64) < off + len {
                        d.resize((off + len) as usize, 0);
                    }
                }
            }
            Err(e) => {
                self.check_err(&what, &e, &["NoSpace"]);
                self.check_nospace(&what, &e, len, free);
            }
        }
        if failed && self.handles.len() == n_handles {
            self.verify_unchanged(hi, &what);
        }
    }

    fn op_punch(&mut self) {
        let Some(hi) = self.writable_handle() else {
            return;
        };
        let (id, flags, orphan) = {
            let h = &self.handles[hi];
            (h.id, h.flags, h.orphan)
        };
        let size = self.m.data.get(&id).map(|d| d.len() as u64).unwrap_or(0);
        let off = match self.rng.gen_range(0..3) {
            0 => self.rng.gen_range(0..MAX_OFF / self.bs) * self.bs,
            _ => self.rng.gen_range(0..=size + 4096),
        };
        let len = match self.rng.gen_range(0..3) {
            0 => self.rng.gen_range(1..=16) * self.bs,
            1 => self.rng.gen_range(1..100),
            _ => self.rng.gen_range(1..=100_000),
        };
        let what = format!(
            "punch_hole(#{id}{}, {off}, {len}), size {size}",
            if orphan { " orphan" } else { "" }
        );
        self.note(what.clone());
        let free = self.free_bytes();
        let r = self.handles[hi].file.punch_hole(off, len);
        self.note_result(&r);
        let failed = r.is_err();
        let n_handles = self.handles.len();
        match r {
            Err(e) if self.stale_orphan(hi, &e) => {}
            Err(e) if flags.read_only => self.check_err(&what, &e, &["any"]),
            Ok(()) if flags.read_only => {
                self.fail(format!("{what}: punch on a read-only handle succeeded"))
            }
            Ok(()) => {
                let d = self.m.data.get_mut(&id).unwrap();
                let end = ((off + len) as usize).min(d.len());
                if (off as usize) < end {
                    d[off as usize..end].fill(0);
                }
            }
            Err(e) => {
                // Punching a partial block can need space (no, it zeroes in
                // place) — but a split extent can need metadata room.
                self.check_err(&what, &e, &["NoSpace"]);
                self.check_nospace(&what, &e, 0, free);
            }
        }
        if failed && self.handles.len() == n_handles {
            self.verify_unchanged(hi, &what);
        }
    }

    fn op_stat(&mut self) {
        let path = self.rand_any_path();
        self.note(format!("stat({path})"));
        let r = self.vol().stat(&path);
        let what = format!("stat({path})");
        if self.m.is_dir(&path) {
            match r {
                Ok(st) if st.kind == FileKind::Directory => {}
                Ok(st) => self.fail(format!("{what}: kind {:?} for a directory", st.kind)),
                Err(e) => self.fail(format!("{what}: {e}")),
            }
        } else if let Some(&id) = self.m.files.get(&path) {
            match r {
                Ok(st) => self.check_stat(&what, &st, id, false),
                Err(e) => self.fail(format!("{what}: {e}")),
            }
        } else {
            let want = self.parent_error(&path).unwrap_or("NotFound");
            match r {
                Ok(_) => self.fail(format!("{what}: succeeded on a missing path")),
                Err(e) => self.check_err(&what, &e, &[want]),
            }
        }
        // And a handle's stat.
        if let Some(hi) =
            (!self.handles.is_empty()).then(|| self.rng.gen_range(0..self.handles.len()))
        {
            let (id, orphan) = (self.handles[hi].id, self.handles[hi].orphan);
            match self.handles[hi].file.stat() {
                Ok(st) => self.check_stat(&format!("fstat(#{id})"), &st, id, orphan),
                Err(e) if self.stale_orphan(hi, &e) => {}
                Err(e) => self.fail(format!("fstat(#{id}): {e}")),
            }
        }
    }

    fn check_stat(&self, what: &str, st: &iomapfs_fs::Stat, id: Id, orphan: bool) {
        let d = &self.m.data[&id];
        if st.size != d.len() as u64 {
            self.fail(format!("{what}: size {} want {}", st.size, d.len()));
        }
        if st.kind != FileKind::Regular {
            self.fail(format!("{what}: kind {:?}", st.kind));
        }
        let want_nlink = if orphan { 0 } else { self.m.names_of(id) };
        if st.nlink != want_nlink {
            self.fail(format!("{what}: nlink {} want {want_nlink}", st.nlink));
        }
        let a = self.m.attrs(id);
        if (st.mode, st.uid, st.gid) != (a.mode, a.uid, a.gid) {
            self.fail(format!(
                "{what}: mode {:#o} owner {}:{}, want {:#o} {}:{}",
                st.mode, st.uid, st.gid, a.mode, a.uid, a.gid
            ));
        }
        if st.st_mode() != libc::S_IFREG | a.mode {
            self.fail(format!("{what}: st_mode {:#o}", st.st_mode()));
        }
        if st.allocated_bytes / self.bs * self.bs != st.allocated_bytes {
            self.fail(format!(
                "{what}: allocated_bytes {} not a multiple of the block size",
                st.allocated_bytes
            ));
        }
        if u64::from(st.block_size) != self.bs {
            self.fail(format!("{what}: block_size {}", st.block_size));
        }
        // Non-zero bytes need space under them.
        let bs = self.bs as usize;
        let data_blocks = d.chunks(bs).filter(|c| c.iter().any(|&b| b != 0)).count() as u64;
        if st.allocated_bytes < data_blocks * self.bs {
            self.fail(format!(
                "{what}: allocated_bytes {} < {} bytes of blocks holding non-zero data",
                st.allocated_bytes,
                data_blocks * self.bs
            ));
        }
    }

    fn op_unlink(&mut self) {
        let path = if self.rng.gen_bool(0.8) && !self.m.files.is_empty() {
            let files: Vec<String> = self.m.files.keys().cloned().collect();
            self.pick(&files)
        } else {
            self.rand_any_path()
        };
        let what = format!("unlink({path})");
        self.note(what.clone());
        let r = self.vol().unlink(&path);
        if self.m.is_dir(&path) {
            match r {
                Ok(()) => self.fail(format!("{what}: unlinked a directory")),
                Err(e) => self.check_err(&what, &e, &["IsDir", "InvalidArgument"]),
            }
        } else if let Some(&id) = self.m.files.get(&path) {
            match r {
                Ok(()) => {
                    self.m.files.remove(&path);
                    self.orphan(id);
                }
                Err(e) => self.fail(format!("{what}: {e}")),
            }
        } else {
            let want = self.parent_error(&path).unwrap_or("NotFound");
            match r {
                Ok(()) => self.fail(format!("{what}: succeeded on a missing path")),
                Err(e) => self.check_err(&what, &e, &[want]),
            }
        }
    }

    fn op_mkdir(&mut self) {
        let path = if self.rng.gen_bool(0.85) {
            self.pick(DIR_POOL).to_string()
        } else {
            self.rand_file_path()
        };
        let what = format!("mkdir({path})");
        self.note(what.clone());
        let free = self.free_bytes();
        let r = self.vol().mkdir(&path);
        if self.m.exists(&path) {
            match r {
                Ok(()) => self.fail(format!("{what}: succeeded on an existing path")),
                Err(e) => self.check_err(&what, &e, &["Exists"]),
            }
        } else if let Some(pe) = self.parent_error(&path) {
            match r {
                Ok(()) => self.fail(format!("{what}: succeeded, want {pe}")),
                Err(e) => self.check_err(&what, &e, &[pe]),
            }
        } else {
            match r {
                Ok(()) => {
                    self.m.dirs.insert(path);
                }
                Err(e) => {
                    self.check_err(&what, &e, &["NoSpace"]);
                    self.check_nospace(&what, &e, 0, free);
                }
            }
        }
    }

    fn op_rmdir(&mut self) {
        let path = if self.rng.gen_bool(0.85) {
            self.pick(DIR_POOL).to_string()
        } else {
            self.rand_file_path()
        };
        let what = format!("rmdir({path})");
        self.note(what.clone());
        let r = self.vol().rmdir(&path);
        if self.m.dirs.contains(&path) {
            let empty = self.m.children(&path).is_empty();
            match r {
                Ok(()) if empty => {
                    self.m.dirs.remove(&path);
                }
                Ok(()) => self.fail(format!("{what}: removed a non-empty directory")),
                Err(e) if !empty => self.check_err(&what, &e, &["NotEmpty"]),
                Err(e) => self.fail(format!("{what}: {e}")),
            }
        } else if self.m.files.contains_key(&path) {
            match r {
                Ok(()) => self.fail(format!("{what}: removed a file")),
                Err(e) => self.check_err(&what, &e, &["NotDir"]),
            }
        } else {
            let want = self.parent_error(&path).unwrap_or("NotFound");
            match r {
                Ok(()) => self.fail(format!("{what}: succeeded on a missing path")),
                Err(e) => self.check_err(&what, &e, &[want]),
            }
        }
    }

    fn op_rename(&mut self) {
        let from = if self.rng.gen_bool(0.7) && !self.m.files.is_empty() {
            let files: Vec<String> = self.m.files.keys().cloned().collect();
            self.pick(&files)
        } else {
            self.rand_any_path()
        };
        let to = if self.rng.gen_bool(0.05) {
            from.clone()
        } else if self.m.is_dir(&from) {
            // Directory targets: a fresh name, inside itself, or anything.
            match self.rng.gen_range(0..4) {
                0 => format!("{from}/sub"),
                _ => self.rand_any_path(),
            }
        } else {
            self.rand_any_path()
        };
        let what = format!("rename({from}, {to})");
        self.note(what.clone());
        let free = self.free_bytes();
        let r = self.vol().rename(&from, &to);
        let expect: Result<(), &[&str]> = if !self.m.exists(&from) || from == "/" {
            Err(&["NotFound", "NotDir", "InvalidArgument"])
        } else if let Some(pe) = self.parent_error(&to) {
            Err(if pe == "NotDir" {
                &["NotDir"]
            } else {
                &["NotFound"]
            })
        } else if from == to {
            Ok(())
        } else if self.m.files.contains_key(&from) {
            if self.m.is_dir(&to) {
                Err(&["IsDir", "Exists", "InvalidArgument"])
            } else {
                Ok(())
            }
        } else {
            // `from` is a directory.
            if to.starts_with(&format!("{from}/")) {
                Err(&["InvalidArgument"])
            } else if self.m.files.contains_key(&to) {
                Err(&["NotDir", "Exists", "InvalidArgument"])
            } else if self.m.is_dir(&to) {
                if self.m.children(&to).is_empty() {
                    // POSIX replaces an empty directory; refusing is fine too.
                    Err(&["ALLOW_OK", "Exists", "NotEmpty", "IsDir", "InvalidArgument"])
                } else {
                    Err(&["NotEmpty", "Exists", "IsDir", "InvalidArgument"])
                }
            } else {
                Ok(())
            }
        };
        match (r, expect) {
            (Ok(()), Ok(())) => self.apply_rename(&from, &to),
            (Ok(()), Err(w)) if w.contains(&"ALLOW_OK") => self.apply_rename(&from, &to),
            (Ok(()), Err(w)) => self.fail(format!("{what}: succeeded, want one of {w:?}")),
            (Err(e), Ok(())) => {
                if matches!(e.root(), Error::NoSpace { .. }) {
                    self.check_nospace(&what, &e, 0, free);
                } else {
                    self.fail(format!("{what}: {e}"))
                }
            }
            // Short of space, the volume may refuse before it looks at the
            // names (POSIX leaves the order of errors open).
            (Err(e), Err(_)) if matches!(e.root(), Error::NoSpace { .. }) => {
                self.check_nospace(&what, &e, 0, free)
            }
            (Err(e), Err(w)) => self.check_err(&what, &e, w),
        }
    }

    fn apply_rename(&mut self, from: &str, to: &str) {
        if from == to {
            return;
        }
        if let Some(&id) = self.m.files.get(from) {
            // Two names of one inode: POSIX rename does nothing.
            if self.m.files.get(to) == Some(&id) {
                return;
            }
            self.m.files.remove(from);
            if let Some(old) = self.m.files.insert(to.to_string(), id) {
                self.orphan(old);
            }
            return;
        }
        // Directory: move it and everything under it.
        self.m.dirs.remove(to);
        let pre = format!("{from}/");
        let dirs: Vec<String> = self
            .m
            .dirs
            .iter()
            .filter(|d| d.starts_with(&pre))
            .cloned()
            .collect();
        self.m.dirs.remove(from);
        self.m.dirs.insert(to.to_string());
        for d in dirs {
            self.m.dirs.remove(&d);
            self.m.dirs.insert(format!("{to}/{}", &d[pre.len()..]));
        }
        let files: Vec<(String, Id)> = self
            .m
            .files
            .iter()
            .filter(|(p, _)| p.starts_with(&pre))
            .map(|(p, &i)| (p.clone(), i))
            .collect();
        for (p, id) in files {
            self.m.files.remove(&p);
            self.m.files.insert(format!("{to}/{}", &p[pre.len()..]), id);
        }
    }

    /// A hard link from a random path (mostly a file) to a random path.
    fn op_link(&mut self) {
        let from = if self.rng.gen_bool(0.8) && !self.m.files.is_empty() {
            let files: Vec<String> = self.m.files.keys().cloned().collect();
            self.pick(&files)
        } else {
            self.rand_any_path()
        };
        let to = self.rand_file_path();
        let what = format!("link({from}, {to})");
        self.note(what.clone());
        let free = self.free_bytes();
        let r = self.vol().link(&from, &to);
        self.note_result(&r);
        let from_error = if from == "/" {
            Some("InvalidArgument")
        } else {
            self.parent_error(&from)
        };
        let expect: Result<(), &[&str]> = if let Some(pe) = from_error {
            Err(if pe == "NotDir" {
                &["NotDir"]
            } else {
                &["NotFound", "InvalidArgument"]
            })
        } else if !self.m.exists(&from) {
            Err(&["NotFound"])
        } else if let Some(pe) = self.parent_error(&to) {
            Err(if pe == "NotDir" {
                &["NotDir"]
            } else {
                &["NotFound"]
            })
        } else if self.m.is_dir(&from) && self.m.exists(&to) {
            Err(&["NotPermitted", "Exists"])
        } else if self.m.is_dir(&from) {
            Err(&["NotPermitted"])
        } else if self.m.exists(&to) {
            Err(&["Exists"])
        } else {
            Ok(())
        };
        match (r, expect) {
            (Ok(()), Ok(())) => {
                let id = self.m.files[&from];
                self.m.files.insert(to, id);
            }
            (Ok(()), Err(w)) => self.fail(format!("{what}: succeeded, want one of {w:?}")),
            (Err(e), Ok(())) => {
                if matches!(e.root(), Error::NoSpace { .. }) {
                    self.check_nospace(&what, &e, 0, free);
                } else {
                    self.fail(format!("{what}: {e}"))
                }
            }
            // Short of space, the volume may refuse before it looks at the
            // names (POSIX leaves the order of errors open).
            (Err(e), Err(_)) if matches!(e.root(), Error::NoSpace { .. }) => {
                self.check_nospace(&what, &e, 0, free)
            }
            (Err(e), Err(w)) => self.check_err(&what, &e, w),
        }
    }

    /// Creates, reads back or removes a symlink at a [`SYMLINK_POOL`] name.
    fn op_symlink(&mut self) {
        let path = self.pick(SYMLINK_POOL).to_string();
        if let Some(target) = self.m.symlinks.get(&path).cloned() {
            if self.rng.gen_bool(0.5) {
                let what = format!("readlink({path})");
                self.note(what.clone());
                match self.vol().readlink(&path) {
                    Ok(t) if t == target.as_bytes() => {}
                    Ok(t) => self.fail(format!("{what}: {t:?} want {target:?}")),
                    Err(e) => self.fail(format!("{what}: {e}")),
                }
                // Opening it as a file is refused (the API follows no symlinks).
                match self.vol().open_file(&path, common::volstate::ro()) {
                    Ok(_) => self.fail(format!("{what}: opened a symlink as a file")),
                    Err(e) if matches!(e.root(), Error::IsSymlink { .. }) => {}
                    Err(e) => self.fail(format!("{what}: open gave {e}, want ELOOP")),
                }
            } else {
                let what = format!("unlink({path}) of a symlink");
                self.note(what.clone());
                match self.vol().unlink(&path) {
                    Ok(()) => {
                        self.m.symlinks.remove(&path);
                    }
                    Err(e) => self.fail(format!("{what}: {e}")),
                }
            }
            return;
        }
        let len = match self.rng.gen_range(0..4) {
            0 => 1,
            1 => 4095,
            _ => self.rng.gen_range(1..300),
        };
        let target: String = (0..len)
            .map(|i| {
                if i % 7 == 3 {
                    '/'
                } else {
                    (b'a' + (i % 26) as u8) as char
                }
            })
            .collect();
        let what = format!("symlink({} bytes, {path})", target.len());
        self.note(what.clone());
        let free = self.free_bytes();
        match self.vol().symlink(&target, &path) {
            Ok(()) => {
                self.m.symlinks.insert(path, target);
            }
            Err(e) if matches!(e.root(), Error::NoSpace { .. }) => {
                self.check_nospace(&what, &e, 0, free)
            }
            Err(e) => self.fail(format!("{what}: {e}")),
        }
    }

    /// A random file of the model: its path, id and inode number.
    fn some_file(&mut self) -> Option<(String, Id, u64)> {
        if self.m.files.is_empty() {
            return None;
        }
        let files: Vec<String> = self.m.files.keys().cloned().collect();
        let path = self.pick(&files);
        let id = self.m.files[&path];
        match self.vol().ino_of(&path) {
            Ok(ino) => Some((path, id, ino)),
            Err(e) => self.fail(format!("ino_of({path}): {e}")),
        }
    }

    /// chmod, chown or utimens of a file by inode; then stat agrees.
    fn op_setattr(&mut self) {
        let Some((path, id, ino)) = self.some_file() else {
            return;
        };
        let mut change = iomapfs_fs::SetAttr::default();
        match self.rng.gen_range(0..4) {
            0 => change.mode = Some(self.rng.gen_range(0..=0o7777)),
            1 => {
                change.uid = Some(self.rng.gen_range(0..70_000));
                change.gid = Some(self.rng.gen_range(0..70_000));
            }
            2 => {
                let t = iomapfs_fs::Timestamp {
                    sec: self.rng.gen_range(-1_000_000_000i64..4_000_000_000),
                    nsec: self.rng.gen_range(0..1_000_000_000),
                };
                change.mtime = Some(iomapfs_fs::TimeSet::At(t));
                change.atime = Some(iomapfs_fs::TimeSet::Now);
            }
            // Refused: bits beyond 0o7777; nothing changes.
            _ => change.mode = Some(0o10000 | self.rng.gen_range(0..0o7777)),
        }
        let what = format!("setattr({path} #{id}, {change:?})");
        self.note(what.clone());
        let before = self.vol().stat(&path).ok();
        let r = self.vol().set_attr(ino, &change);
        self.note_result(&r);
        let bad_mode = change.mode.is_some_and(|m| m > 0o7777);
        match r {
            Ok(st) if !bad_mode => {
                let a = self.m.attrs.entry(id).or_default();
                a.mode = change.mode.unwrap_or(a.mode);
                a.uid = change.uid.unwrap_or(a.uid);
                a.gid = change.gid.unwrap_or(a.gid);
                if let Some(iomapfs_fs::TimeSet::At(t)) = change.mtime {
                    if st.mtime != t {
                        self.fail(format!("{what}: mtime {:?} want {t:?}", st.mtime));
                    }
                }
                let before = before.unwrap();
                if st.ctime < before.ctime {
                    self.fail(format!(
                        "{what}: ctime went back {:?} -> {:?}",
                        before.ctime, st.ctime
                    ));
                }
                self.check_stat(&what, &st, id, false);
            }
            Ok(_) => self.fail(format!("{what}: accepted mode bits beyond 0o7777")),
            Err(e) if bad_mode => self.check_err(&what, &e, &["InvalidArgument"]),
            Err(e) => self.fail(format!("{what}: {e}")),
        }
    }

    /// set (any, create, replace), get, list or remove a `user.` xattr, or
    /// a refused name.
    fn op_xattr(&mut self) {
        for _ in 0..self.rng.gen_range(1..=6) {
            self.op_xattr_once();
        }
    }

    fn op_xattr_once(&mut self) {
        let Some((path, id, ino)) = self.some_file() else {
            return;
        };
        let existing: Vec<String> = self.m.attrs(id).xattrs.keys().cloned().collect();
        let name = if !existing.is_empty() && self.rng.gen_bool(0.5) {
            self.pick(&existing)
        } else {
            self.pick(XATTR_POOL).to_string()
        };
        let have = self.m.attrs(id).xattrs.get(&name).cloned();
        let free = self.free_bytes();
        match self.rng.gen_range(0..6) {
            0 | 1 => {
                let how = self.pick(&[
                    iomapfs_fs::XattrSet::Any,
                    iomapfs_fs::XattrSet::Create,
                    iomapfs_fs::XattrSet::Replace,
                ]);
                let len = self.rng.gen_range(0..2000);
                let value = gen_data(&mut self.rng, len);
                let what = format!("setxattr({path} #{id}, {name}, {len} bytes, {how:?})");
                self.note(what.clone());
                let r = self.vol().set_xattr(ino, &name, &value, how);
                self.note_result(&r);
                let want: Result<(), &str> = match (how, &have) {
                    (iomapfs_fs::XattrSet::Create, Some(_)) => Err("Exists"),
                    (iomapfs_fs::XattrSet::Replace, None) => Err("NoXattr"),
                    _ => Ok(()),
                };
                match (r, want) {
                    (Ok(()), Ok(())) => {
                        self.m
                            .attrs
                            .entry(id)
                            .or_default()
                            .xattrs
                            .insert(name, value);
                    }
                    (Err(e), Ok(())) if matches!(e.root(), Error::NoSpace { .. }) => {
                        self.check_nospace(&what, &e, 0, free)
                    }
                    (Err(e), Err(w)) if errno_name(&e) == w => {}
                    (r, w) => self.fail(format!("{what}: {r:?}, want {w:?}")),
                }
            }
            2 => {
                let what = format!("getxattr({path} #{id}, {name})");
                self.note(what.clone());
                match (self.vol().get_xattr(ino, &name), have) {
                    (Ok(v), Some(w)) if v == w => {}
                    (Err(e), None) if errno_name(&e) == "NoXattr" => {}
                    (r, w) => self.fail(format!("{what}: {r:?}, want {w:?}")),
                }
            }
            3 => {
                let what = format!("listxattr({path} #{id})");
                self.note(what.clone());
                let want: Vec<String> = self.m.attrs(id).xattrs.keys().cloned().collect();
                match self.vol().list_xattr(ino) {
                    Ok(v) if v == want => {}
                    r => self.fail(format!("{what}: {r:?}, want {want:?}")),
                }
            }
            4 => {
                let what = format!("removexattr({path} #{id}, {name})");
                self.note(what.clone());
                match (self.vol().remove_xattr(ino, &name), have) {
                    (Ok(()), Some(_)) => {
                        self.m.attrs.entry(id).or_default().xattrs.remove(&name);
                    }
                    (Err(e), None) if errno_name(&e) == "NoXattr" => {}
                    (r, w) => self.fail(format!("{what}: {r:?}, had {:?}", w.map(|v| v.len()))),
                }
            }
            _ => {
                // Other namespaces are not stored; a bare prefix is invalid.
                let bad = self.pick(&[
                    "trusted.x",
                    "security.x",
                    "system.posix_acl_access",
                    "user.",
                    "x",
                ]);
                let what = format!("setxattr({path} #{id}, {bad}) refused");
                self.note(what.clone());
                match self
                    .vol()
                    .set_xattr(ino, bad, b"v", iomapfs_fs::XattrSet::Any)
                {
                    Ok(()) => self.fail(format!("{what}: accepted")),
                    Err(e) => {
                        let want = if bad.starts_with("user.") {
                            libc::EINVAL
                        } else {
                            libc::EOPNOTSUPP
                        };
                        if e.errno() != want {
                            self.fail(format!("{what}: errno {} want {want}: {e}", e.errno()));
                        }
                    }
                }
            }
        }
    }

    fn op_readdir(&mut self) {
        let path = if self.rng.gen_bool(0.8) {
            let mut dirs: Vec<String> = self.m.dirs.iter().cloned().collect();
            dirs.push("/".into());
            self.pick(&dirs)
        } else {
            self.rand_any_path()
        };
        let what = format!("readdir({path})");
        self.note(what.clone());
        let r = self.vol().readdir(&path);
        if self.m.is_dir(&path) {
            match r {
                Ok(entries) => {
                    let got: BTreeMap<String, FileKind> =
                        entries.iter().map(|e| (e.name.clone(), e.kind)).collect();
                    if got.len() != entries.len() {
                        self.fail(format!("{what}: duplicate names {entries:?}"));
                    }
                    let want = self.m.children(&path);
                    if got != want {
                        self.fail(format!("{what}: got {got:?} want {want:?}"));
                    }
                }
                Err(e) => self.fail(format!("{what}: {e}")),
            }
        } else if self.m.files.contains_key(&path) {
            match r {
                Ok(_) => self.fail(format!("{what}: listed a file")),
                Err(e) => self.check_err(&what, &e, &["NotDir"]),
            }
        } else {
            let want = self.parent_error(&path).unwrap_or("NotFound");
            match r {
                Ok(_) => self.fail(format!("{what}: listed a missing path")),
                Err(e) => self.check_err(&what, &e, &[want]),
            }
        }
    }

    fn op_sync(&mut self) {
        match self.rng.gen_range(0..4) {
            0 | 1 if !self.handles.is_empty() => {
                let hi = self.rng.gen_range(0..self.handles.len());
                let data = self.rng.gen_bool(0.5);
                let id = self.handles[hi].id;
                self.note(format!(
                    "{}(#{id})",
                    if data { "fdatasync" } else { "fsync" }
                ));
                let r = if data {
                    self.handles[hi].file.fdatasync()
                } else {
                    self.handles[hi].file.fsync()
                };
                match r {
                    Err(e) if self.stale_orphan(hi, &e) => {}
                    Err(e) => self.fail(format!("fsync(#{id}): {e}")),
                    Ok(()) => {}
                }
            }
            2 => {
                self.note("checkpoint".into());
                if let Err(e) = self.vol().checkpoint() {
                    self.fail(format!("checkpoint: {e}"));
                }
            }
            _ => {
                self.note("sync".into());
                if let Err(e) = self.vol().sync() {
                    self.fail(format!("sync: {e}"));
                }
            }
        }
    }

    fn op_close(&mut self) {
        if self.handles.is_empty() {
            return;
        }
        let hi = self.rng.gen_range(0..self.handles.len());
        let h = self.handles.remove(hi);
        self.note(format!(
            "close(#{}{})",
            h.id,
            if h.orphan { " orphan" } else { "" }
        ));
        let id = h.id;
        drop(h);
        if !self.m.files.values().any(|&v| v == id) && !self.handles.iter().any(|h| h.id == id) {
            self.m.data.remove(&id);
        }
    }

    /// Fills the device with one file until ENOSPC, then checks that the
    /// failed write changed nothing.
    fn op_fill(&mut self) {
        let path = "/fill";
        self.note("fill device".into());
        let f = match self.vol().open_file(
            path,
            OpenFlags {
                create: true,
                direct: true,
                ..OpenFlags::default()
            },
        ) {
            Ok(f) => f,
            Err(e) if e.errno() == libc::ENOSPC => return,
            Err(e) if matches!(e.root(), Error::IsDir { .. } | Error::NotDir { .. }) => return,
            Err(e) => self.fail(format!("open {path}: {e}")),
        };
        let id = match self.m.files.get(path) {
            Some(&id) => id,
            None => {
                self.m.next += 1;
                let id = self.m.next;
                self.m.files.insert(path.into(), id);
                self.m.data.insert(id, Vec::new());
                id
            }
        };
        let chunk = 512 * 1024u64;
        let mut hit = false;
        for _ in 0..64 {
            let off = self.m.data[&id].len() as u64;
            let off = off.div_ceil(self.lbs) * self.lbs;
            let data = vec![self.rng.gen::<u8>() | 1; chunk as usize];
            let free = self.free_bytes();
            let size_before = f.stat().map(|s| s.size).unwrap_or(0);
            match f.pwrite(&data, off) {
                Ok(n) => {
                    let d = self.m.data.get_mut(&id).unwrap();
                    d.resize(off as usize, 0);
                    d.extend_from_slice(&data[..n]);
                    if (n as u64) < chunk {
                        hit = true;
                        break;
                    }
                }
                Err(e) => {
                    self.check_err("fill write", &e, &["NoSpace"]);
                    self.check_nospace("fill write", &e, chunk, free);
                    let size = f.stat().map(|s| s.size).unwrap_or(u64::MAX);
                    if size != size_before {
                        self.fail(format!(
                            "fill write: ENOSPC but size changed {size_before} -> {size}"
                        ));
                    }
                    hit = true;
                    break;
                }
            }
        }
        if !hit {
            self.fail("fill: 32 MiB written to an 8 MiB device without ENOSPC".into());
        }
        self.push_handle(
            id,
            f,
            OpenFlags {
                direct: true,
                ..OpenFlags::default()
            },
        );
        self.verify_all("after filling the device");
    }

    // ---- whole-volume checks ---------------------------------------------

    fn verify_all(&mut self, ctx: &str) {
        let st = match common::volstate::read_volume(self.vol(), u64::MAX) {
            Ok(s) => s,
            Err(e) => self.fail(format!("{ctx}: {e}")),
        };
        if st.dirs != self.m.dirs {
            self.fail(format!("{ctx}: dirs {:?} want {:?}", st.dirs, self.m.dirs));
        }
        let got: Vec<&String> = st.files.keys().collect();
        let want: Vec<&String> = self.m.files.keys().collect();
        if got != want {
            self.fail(format!("{ctx}: files {got:?} want {want:?}"));
        }
        if st.symlinks != self.m.symlinks {
            self.fail(format!(
                "{ctx}: symlinks {:?} want {:?}",
                st.symlinks, self.m.symlinks
            ));
        }
        let mut ino_of: HashMap<Id, u64> = HashMap::new();
        for (p, &id) in &self.m.files {
            let a = self.m.attrs(id);
            let g = &st.attrs[p];
            if (g.mode, g.uid, g.gid, &g.xattrs) != (a.mode, a.uid, a.gid, &a.xattrs)
                || g.nlink != self.m.names_of(id)
            {
                self.fail(format!("{ctx}: {p} (#{id}): attributes {g:?} want {a:?}"));
            }
            if *ino_of.entry(id).or_insert(g.ino) != g.ino {
                self.fail(format!(
                    "{ctx}: {p} (#{id}): a hard link became another inode"
                ));
            }
        }
        if ino_of.values().collect::<BTreeSet<_>>().len() != ino_of.len() {
            self.fail(format!("{ctx}: two model files share an inode: {ino_of:?}"));
        }
        for (p, &id) in &self.m.files {
            let w = &self.m.data[&id];
            let g = &st.files[p].data;
            if g != w {
                let at = first_diff(g, w).unwrap();
                self.fail(format!(
                    "{ctx}: {p} (#{id}, size {} want {}) differs at {at}: got {} want {}",
                    g.len(),
                    w.len(),
                    excerpt(g, at),
                    excerpt(w, at)
                ));
            }
        }
    }

    /// fiemap: ordered, non-overlapping, block-aligned, inside the device,
    /// and every non-zero byte in a data range.
    fn verify_fiemap(&self, ctx: &str) {
        let dev_size = self.dev.caps().size_bytes;
        for (p, &id) in &self.m.files {
            let f = match self.vol().open_file(p, common::volstate::ro()) {
                Ok(f) => f,
                Err(e) => self.fail(format!("{ctx}: open {p}: {e}")),
            };
            let map = match f.fiemap() {
                Ok(m) => m,
                Err(e) => self.fail(format!("{ctx}: fiemap {p}: {e}")),
            };
            let mut end = 0u64;
            for x in &map {
                if x.offset < end || x.length == 0 {
                    self.fail(format!(
                        "{ctx}: fiemap {p}: unordered/empty range {x:?} in {map:?}"
                    ));
                }
                end = x.offset + x.length;
                if x.kind != FiemapKind::Hole {
                    if x.offset % self.bs != 0 || x.length % self.bs != 0 || x.addr % self.bs != 0 {
                        self.fail(format!("{ctx}: fiemap {p}: unaligned {x:?}"));
                    }
                    if x.addr + x.length > dev_size || x.addr == 0 {
                        self.fail(format!("{ctx}: fiemap {p}: {x:?} outside the device"));
                    }
                }
            }
            // Every byte outside the data ranges reads as zero.
            let d = &self.m.data[&id];
            let mut pos = 0usize;
            let check_zero = |from: usize, to: usize| -> Option<usize> {
                let to = to.min(d.len());
                if from >= to {
                    return None;
                }
                d[from..to].iter().position(|&b| b != 0).map(|i| i + from)
            };
            let mut bad = None;
            for x in map.iter().filter(|x| x.kind == FiemapKind::Data) {
                bad = bad.or(check_zero(pos, x.offset as usize));
                pos = pos.max((x.offset + x.length) as usize);
            }
            bad = bad.or(check_zero(pos, d.len()));
            if let Some(i) = bad {
                self.fail(format!(
                    "{ctx}: fiemap {p}: non-zero byte at {i} not in a data range: {map:?}"
                ));
            }
        }
    }

    /// Space accounting: fsck's used bytes equal the files' allocations, and
    /// statfs agrees. Only with no handles open (orphans hold space).
    fn verify_accounting(&self, ctx: &str, report: &iomapfs_fs::fsck::FsckReport) {
        let mut alloc = 0;
        let mut seen = BTreeSet::new();
        for (p, id) in &self.m.files {
            if !seen.insert(id) {
                continue; // another name of a file counted already
            }
            match self.vol().stat(p) {
                Ok(s) => alloc += s.allocated_bytes,
                Err(e) => self.fail(format!("{ctx}: stat {p}: {e}")),
            }
        }
        if report.used_bytes != alloc + report.metadata_bytes {
            self.fail(format!(
                "{ctx}: fsck used_bytes {} != {} allocated by the files + {} of checkpoint metadata (leak?)",
                report.used_bytes, alloc, report.metadata_bytes
            ));
        }
        // Metadata bytes: the checkpoints' spilled images and extent pages,
        // and the room kept free for the next base (with extent pages, a
        // page per chunk of every paged file, pages on disk or not yet).
        let sf = self.vol().statfs();
        if sf.data_bytes != report.data_bytes
            || sf.free_bytes + alloc + sf.metadata_bytes != sf.data_bytes
        {
            self.fail(format!(
                "{ctx}: statfs {sf:?}: free + allocated + metadata ({} + {alloc} + {}) != data bytes; fsck data_bytes {}",
                sf.free_bytes, sf.metadata_bytes, report.data_bytes
            ));
        }
    }

    fn reopen(&mut self, clean: bool) {
        self.note(format!(
            "reopen({})",
            if clean { "unmount" } else { "sync + drop" }
        ));
        if !clean {
            for h in &self.handles {
                if let Err(e) = h.file.fsync() {
                    if !(h.orphan && matches!(e.root(), Error::Stale { .. })) {
                        self.fail(format!("fsync before drop: {e}"));
                    }
                }
            }
        }
        self.handles.clear();
        let live: BTreeSet<Id> = self.m.files.values().copied().collect();
        self.m.data.retain(|id, _| live.contains(id));
        let vol = self.vol.take().unwrap();
        if clean {
            if let Err(e) = vol.unmount() {
                self.fail(format!("unmount: {e}"));
            }
        } else {
            if let Err(e) = vol.sync() {
                self.fail(format!("sync: {e}"));
            }
            drop(vol);
        }
        let report = fsck_clean(self.dev.clone(), &self.ctx());
        match common::open_replayable(self.dev.clone()) {
            Ok(v) => self.vol = Some(v),
            Err(e) => self.fail(format!("open after reopen: {e}")),
        }
        self.verify_all("after reopen");
        self.verify_fiemap("after reopen");
        self.verify_accounting("after reopen", &report);
        let _ = &self.mem;
    }

    fn run(&mut self, ops: usize) {
        for _ in 0..ops {
            match self.rng.gen_range(0..100) {
                0..=11 => self.op_open(),
                12..=35 => self.op_write(),
                36..=49 => self.op_read(),
                50..=54 => self.op_truncate(),
                55..=58 => self.op_fallocate(false),
                59 => self.op_fallocate(true),
                60..=63 => self.op_punch(),
                64..=66 => self.op_stat(),
                67..=70 => self.op_unlink(),
                71..=73 => self.op_mkdir(),
                74..=75 => self.op_rmdir(),
                76..=77 => self.op_rename(),
                78 => self.op_link(),
                79..=80 => match self.rng.gen_range(0..3) {
                    0 => self.op_symlink(),
                    1 => self.op_setattr(),
                    _ => self.op_xattr(),
                },
                81..=83 => self.op_readdir(),
                84..=88 => self.op_sync(),
                89..=93 => self.op_close(),
                94 if self.rng.gen_bool(0.5) => self.op_fill(),
                95..=96 => self.reopen(true),
                97..=98 => self.reopen(false),
                _ => self.verify_all("mid-case"),
            }
            common::watchdog().beat();
        }
        self.verify_all("end of case");
        let clean = self.rng.gen_bool(0.5);
        self.reopen(clean);
        self.handles.clear();
        let vol = self.vol.take().unwrap();
        if let Err(e) = vol.unmount() {
            self.fail(format!("final unmount: {e}"));
        }
        fsck_clean(self.dev.clone(), &format!("final fsck; {}", self.ctx()));
    }
}

/// The model cases run as this many tests, so the harness spreads them
/// over the cores.
const SHARDS: u64 = 4;

/// Runs shard `shard`'s cases: every `SHARDS`-th seed, until the shard's
/// share of the operation target is done (or its share of
/// `IOMAPFS_MODEL_CASES`, when set).
fn model_shard(shard: u64) {
    let t0 = Instant::now();
    let name = format!("model shard {shard}/{SHARDS}");
    let seeds = Seeds::from_env(&name);
    if seeds.fixed.is_some() && shard != 0 {
        return; // the one case runs in shard 0
    }
    let cases = std::env::var_os("IOMAPFS_MODEL_CASES")
        .map(|_| env_u64("IOMAPFS_MODEL_CASES", 0).div_ceil(SHARDS));
    let ops_target = env_u64("IOMAPFS_MODEL_TOTAL_OPS", 1_000_000).div_ceil(SHARDS);
    let max_ops = env_u64("IOMAPFS_MODEL_OPS", 150) as usize;
    let stats = Stats::default();
    let mut i = shard;
    let mut done = 0u64;
    loop {
        let seed = seeds.case(i);
        run_case("model", seed, "model case", || {
            let mut c = Case::new(seed);
            let ops = c.rng.gen_range(1..=max_ops);
            c.run(ops);
            stats.add("ops", c.log.len() as u64);
        });
        stats.add("cases", 1);
        done += 1;
        i += SHARDS;
        let finished = match cases {
            _ if seeds.fixed.is_some() => true,
            Some(n) => done >= n,
            None => stats.get("ops") >= ops_target,
        };
        if finished {
            break;
        }
    }
    stats.print(&name, t0.elapsed());
}

#[test]
fn model_differential_shard_0() {
    model_shard(0);
}

#[test]
fn model_differential_shard_1() {
    model_shard(1);
}

#[test]
fn model_differential_shard_2() {
    model_shard(2);
}

#[test]
fn model_differential_shard_3() {
    model_shard(3);
}
