//! The crash model: every version of the namespace and of every file a
//! workload produced, and a checker that decides whether a recovered volume
//! is a state a correct implementation could have left behind.
//!
//! Time is counted in *boundaries*: boundary `i` is the moment after `i`
//! operations completed. A power cut during operation `i` may leave anything
//! from the last durable boundary `lo` up to boundary `i + 1`.
//!
//! What the checker demands of a recovered state (window `[lo, hi]`,
//! `completed` = operations that had returned before the cut):
//! - namespace: equal to the namespace at some boundary in the window (the
//!   journal is one ordered log, so metadata recovers to a prefix) — and it
//!   contains every file a returned DSYNC write reached;
//! - size of each file: between the smallest and the largest size that file
//!   had in the window, and never below what a returned DSYNC write needed;
//! - each byte at offset X: the byte some version of that file in the window
//!   had at X (a byte past a version's EOF counts as zero). Bytes covered by
//!   a returned DSYNC write only from versions at or after that write.
//!
//! Together: no stale data (invariant 1), durability of synced state
//! (invariant 2: when lo is the last sync, only versions from lo on are
//! allowed, so an unmodified file is exact), atomic metadata (invariant 3),
//! and size only covering written data (invariant 4: bytes under EOF must be
//! attributable; the device is pre-filled with a marker).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::volstate::VolState;

/// Model inode identity: follows a file across renames.
pub type Id = u32;

/// The device is filled with this before `format`: it must never be read back.
pub const MARKER: &[u8; 8] = b"STALE!!!";

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Namespace {
    pub dirs: BTreeSet<String>,
    /// Path -> file; two paths with one id are hard links.
    pub files: BTreeMap<String, Id>,
    /// Path -> target.
    pub symlinks: BTreeMap<String, String>,
    /// Attributes of files that changed them (the others have the defaults).
    pub attrs: BTreeMap<Id, ModelAttrs>,
}

/// What the model keeps of a file's attributes: journaled with the names,
/// so they recover to the same prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelAttrs {
    pub mode: u32,
    /// `None`: the creating process's user and group.
    pub owner: Option<(u32, u32)>,
    pub xattrs: BTreeMap<String, Vec<u8>>,
}

impl Default for ModelAttrs {
    fn default() -> Self {
        ModelAttrs {
            mode: 0o644,
            owner: None,
            xattrs: BTreeMap::new(),
        }
    }
}

impl Namespace {
    pub fn same_names(&self, st: &VolState) -> bool {
        self.dirs == st.dirs
            && self.symlinks == st.symlinks
            && self.files.len() == st.files.len()
            && self.files.keys().zip(st.files.keys()).all(|(a, b)| a == b)
            && self.same_attrs(st).is_ok()
    }

    /// Attributes, link counts and hard-link identity of every file agree
    /// with `st` (whose names are those of `self`).
    pub fn same_attrs(&self, st: &VolState) -> Result<(), String> {
        let mut ino_of: BTreeMap<Id, u64> = BTreeMap::new();
        let mut id_of: BTreeMap<u64, Id> = BTreeMap::new();
        for (path, &id) in &self.files {
            let Some(got) = st.attrs.get(path) else {
                return Err(format!("{path}: no attributes read"));
            };
            let want = self.attrs.get(&id).cloned().unwrap_or_default();
            if got.mode != want.mode || got.xattrs != want.xattrs {
                return Err(format!(
                    "{path} (#{id}): mode {:#o} xattrs {:?}, want mode {:#o} xattrs {:?}",
                    got.mode,
                    got.xattrs.keys().collect::<Vec<_>>(),
                    want.mode,
                    want.xattrs.keys().collect::<Vec<_>>()
                ));
            }
            if let Some((uid, gid)) = want.owner {
                if (got.uid, got.gid) != (uid, gid) {
                    return Err(format!(
                        "{path} (#{id}): owner {}:{} want {uid}:{gid}",
                        got.uid, got.gid
                    ));
                }
            }
            let names = self.files.values().filter(|&&v| v == id).count() as u32;
            if got.nlink != names {
                return Err(format!("{path} (#{id}): nlink {} want {names}", got.nlink));
            }
            if *ino_of.entry(id).or_insert(got.ino) != got.ino
                || *id_of.entry(got.ino).or_insert(id) != id
            {
                return Err(format!(
                    "{path} (#{id}): inode {} breaks the hard links of the model",
                    got.ino
                ));
            }
        }
        Ok(())
    }

    pub fn contains_id(&self, id: Id) -> bool {
        self.files.values().any(|&v| v == id)
    }
    pub fn describe(&self) -> String {
        let files: Vec<String> = self.files.iter().map(|(k, v)| format!("{k}#{v}")).collect();
        let attrs: Vec<String> = self
            .attrs
            .iter()
            .map(|(id, a)| {
                let x: Vec<String> = a
                    .xattrs
                    .iter()
                    .map(|(n, v)| format!("{n}={}B", v.len()))
                    .collect();
                format!("#{id}: {:o} {:?} [{}]", a.mode, a.owner, x.join(" "))
            })
            .collect();
        let links: Vec<String> = self
            .symlinks
            .iter()
            .map(|(p, t)| format!("{p}->{:.12}", t))
            .collect();
        format!(
            "dirs {:?} files [{}] symlinks [{}] attrs [{}]",
            self.dirs,
            files.join(", "),
            links.join(", "),
            attrs.join(", ")
        )
    }
}

/// Shared with a power-cut hook, which runs inside device requests.
#[derive(Debug, Default)]
pub struct Progress {
    completed: AtomicUsize,
    in_op: AtomicUsize,
    durable: AtomicUsize,
}

/// What a cut at some moment may recover to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// Last boundary made durable by a returned sync.
    pub lo: usize,
    /// Operations that had returned.
    pub completed: usize,
    /// `completed`, plus one if an operation was in progress.
    pub hi: usize,
}

impl Progress {
    pub fn window(&self) -> Window {
        // `in_op` is set before `completed` moves and cleared after, so a
        // racing reader errs on the wide side.
        let in_op = self.in_op.load(Ordering::SeqCst);
        let completed = self.completed.load(Ordering::SeqCst);
        let lo = self.durable.load(Ordering::SeqCst);
        Window {
            lo,
            completed,
            hi: completed + in_op.min(1),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Floor {
    from: u64,
    to: u64,
    /// Boundary at which the DSYNC write returned.
    at: usize,
}

/// Versions of one thing, each with the boundary it became current at.
type Versions<T> = Vec<(usize, Arc<T>)>;

#[derive(Default)]
pub struct History {
    boundary: usize,
    ns_versions: Versions<Namespace>,
    versions: HashMap<Id, Versions<Vec<u8>>>,
    floors: HashMap<Id, Vec<Floor>>,
    pub progress: Arc<Progress>,
    /// The state being built by the operation in progress.
    pub ns: Namespace,
    pub files: HashMap<Id, Vec<u8>>,
    dirty: BTreeSet<Id>,
    ns_dirty: bool,
    pending_floor: Vec<(Id, Floor)>,
    pending_durable: bool,
    /// Boundaries at which one file's data and metadata were made durable
    /// (its `fsync`), in order; `fsync` of one file does not write back
    /// another's cached data, so it does not move the global `durable`.
    file_syncs: HashMap<Id, Vec<usize>>,
    pending_file_sync: Option<Id>,
    next_id: Id,
    pub op_names: Vec<String>,
    /// Highest write id used, for attributing bytes in messages.
    pub max_wid: u64,
}

impl History {
    pub fn new() -> History {
        let mut h = History::default();
        h.ns_versions.push((0, Arc::new(Namespace::default())));
        h.op_names.push("<start>".into());
        h
    }

    pub fn boundary(&self) -> usize {
        self.boundary
    }

    pub fn begin(&mut self, name: impl Into<String>) {
        assert_eq!(self.progress.in_op.load(Ordering::SeqCst), 0, "nested op");
        self.op_names.push(name.into());
        self.progress.in_op.store(1, Ordering::SeqCst);
    }

    /// Ends the operation in progress. `durable`: it was a sync that returned
    /// successfully, so everything up to the new boundary is durable.
    pub fn end(&mut self) {
        let b = self.boundary + 1;
        if self.ns_dirty {
            self.ns_versions.push((b, Arc::new(self.ns.clone())));
            self.ns_dirty = false;
        }
        for id in std::mem::take(&mut self.dirty) {
            let data = self.files.get(&id).cloned().unwrap_or_default();
            self.versions
                .entry(id)
                .or_default()
                .push((b, Arc::new(data)));
        }
        if let Some(id) = self.pending_file_sync.take() {
            self.file_syncs.entry(id).or_default().push(b);
        }
        for (id, mut f) in self.pending_floor.drain(..) {
            f.at = b;
            self.floors.entry(id).or_default().push(f);
        }
        self.boundary = b;
        self.progress.completed.store(b, Ordering::SeqCst);
        if std::mem::take(&mut self.pending_durable) {
            self.progress.durable.store(b, Ordering::SeqCst);
        }
        self.progress.in_op.store(0, Ordering::SeqCst);
    }

    /// Drops what the operation in progress recorded as durable (it failed).
    pub fn end_failed(&mut self) {
        self.pending_durable = false;
        self.pending_file_sync = None;
        self.pending_floor.clear();
        self.end();
    }

    /// The operation in progress makes everything durable (sync,
    /// checkpoint): it counts once the operation ends successfully.
    pub fn mark_durable(&mut self) {
        self.pending_durable = true;
    }

    /// The operation in progress makes file `id` durable (its `fsync`).
    pub fn mark_file_durable(&mut self, id: Id) {
        self.pending_file_sync = Some(id);
    }

    /// The lowest boundary file `id` may recover to under window `w`: the
    /// global durable boundary, or this file's last `fsync` that had
    /// returned by the cut.
    fn file_lo(&self, id: Id, w: Window) -> usize {
        let synced = self
            .file_syncs
            .get(&id)
            .and_then(|b| b.iter().rev().find(|&&b| b <= w.completed))
            .copied()
            .unwrap_or(0);
        w.lo.max(synced)
    }

    /// A DSYNC write of `[from, to)` to `id` is in progress; it counts once
    /// the operation ends successfully.
    pub fn mark_dsync(&mut self, id: Id, from: u64, to: u64) {
        if to > from {
            self.pending_floor.push((id, Floor { from, to, at: 0 }));
        }
    }

    pub fn new_file(&mut self, path: &str) -> Id {
        self.next_id += 1;
        let id = self.next_id;
        self.files.insert(id, Vec::new());
        self.dirty.insert(id);
        self.ns.files.insert(path.to_string(), id);
        self.ns_dirty = true;
        id
    }

    pub fn data_mut(&mut self, id: Id) -> &mut Vec<u8> {
        self.dirty.insert(id);
        self.files.get_mut(&id).expect("unknown id")
    }

    pub fn data(&self, id: Id) -> &[u8] {
        &self.files[&id]
    }

    pub fn ns_mut(&mut self) -> &mut Namespace {
        self.ns_dirty = true;
        &mut self.ns
    }

    /// Versions of `id` that were current at some boundary in `[lo, hi]`.
    fn versions_in(&self, id: Id, lo: usize, hi: usize) -> Vec<&Arc<Vec<u8>>> {
        let Some(vs) = self.versions.get(&id) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (i, (from, data)) in vs.iter().enumerate() {
            let until = vs.get(i + 1).map(|v| v.0).unwrap_or(usize::MAX); // exclusive
            if *from <= hi && until > lo {
                out.push(data);
            }
        }
        out
    }

    fn ns_in(&self, lo: usize, hi: usize) -> Vec<(usize, &Arc<Namespace>)> {
        let vs = &self.ns_versions;
        let mut out = Vec::new();
        for (i, (from, ns)) in vs.iter().enumerate() {
            let until = vs.get(i + 1).map(|v| v.0).unwrap_or(usize::MAX);
            if *from <= hi && until > lo {
                out.push(((*from).max(lo), ns));
            }
        }
        out
    }

    /// The latest state, for live comparisons.
    pub fn latest(&self) -> (&Namespace, &HashMap<Id, Vec<u8>>) {
        (&self.ns, &self.files)
    }

    /// Checks a recovered state against window `w`. `Err` explains.
    pub fn check(&self, st: &VolState, w: Window) -> Result<Namespace, String> {
        for (path, fd) in &st.files {
            if let Some(at) = find_marker(&fd.data) {
                return Err(format!(
                    "STALE DATA: {path} (size {}) holds the device fill marker at file offset {at}",
                    fd.size
                ));
            }
        }
        // Files a returned DSYNC write must keep reachable.
        let mut required = BTreeSet::new();
        for (&id, floors) in &self.floors {
            for f in floors {
                if f.at <= w.completed
                    && f.at >= w.lo
                    && self
                        .ns_in(f.at, w.hi)
                        .iter()
                        .all(|(_, ns)| ns.contains_id(id))
                {
                    required.insert(id);
                }
            }
        }
        let cands: Vec<_> = self
            .ns_in(w.lo, w.hi)
            .into_iter()
            .filter(|(_, ns)| ns.same_names(st))
            .collect();
        if cands.is_empty() {
            let lo_ns = self.ns_in(w.lo, w.lo);
            let hi_ns = self.ns_in(w.hi, w.hi);
            return Err(format!(
                "NAMESPACE: recovered {{dirs {:?} files {:?} symlinks {:?}}} matches no boundary in [{}, {}]\n  at lo: {}\n  at hi: {}\n  attributes against hi: {:?}\n  ops in window: {:?}",
                st.dirs,
                st.files.keys().collect::<Vec<_>>(),
                st.symlinks,
                w.lo,
                w.hi,
                lo_ns.first().map(|v| v.1.describe()).unwrap_or_default(),
                hi_ns.first().map(|v| v.1.describe()).unwrap_or_default(),
                hi_ns.first().map(|v| v.1.same_attrs(st)),
                self.ops_in(w),
            ));
        }
        let mut first_err = None;
        for (b, ns) in &cands {
            let missing: Vec<_> = required.iter().filter(|id| !ns.contains_id(**id)).collect();
            if !missing.is_empty() {
                first_err.get_or_insert(format!(
                    "DURABILITY: files #{missing:?} had returned DSYNC writes but are missing (namespace of boundary {b})"
                ));
                continue;
            }
            let mut res: Result<(), String> = Ok(());
            for (path, &id) in &ns.files {
                if let Err(e) = self.check_file(id, &st.files[path], w) {
                    res = Err(format!("{path} (#{id}, namespace of boundary {b}): {e}"));
                    break;
                }
            }
            match res {
                Ok(()) => return Ok(Namespace::clone(ns)),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        Err(format!(
            "{}\n  window lo={} completed={} hi={}; ops in window: {:?}",
            first_err.unwrap(),
            w.lo,
            w.completed,
            w.hi,
            self.ops_in(w)
        ))
    }

    fn ops_in(&self, w: Window) -> Vec<String> {
        // op i moves boundary i-1 -> i (op_names[0] is the start).
        let lo = w.lo.saturating_sub(1);
        let hi = (w.hi + 1).min(self.op_names.len());
        (lo..hi)
            .map(|i| format!("{i}:{}", self.op_names[i]))
            .collect()
    }

    fn check_file(&self, id: Id, fd: &super::volstate::FileData, w: Window) -> Result<(), String> {
        let w = Window {
            lo: self.file_lo(id, w),
            ..w
        };
        let vs = self.versions_in(id, w.lo, w.hi);
        if vs.is_empty() {
            return Err("no version of this file in the window".into());
        }
        let floors: Vec<Floor> = self
            .floors
            .get(&id)
            .map(|f| {
                f.iter()
                    .filter(|f| f.at <= w.completed && f.at > w.lo)
                    .copied()
                    .collect()
            })
            .unwrap_or_default();
        // Size.
        let min = vs.iter().map(|v| v.len() as u64).min().unwrap();
        let max = vs.iter().map(|v| v.len() as u64).max().unwrap();
        if fd.size < min || fd.size > max {
            return Err(format!(
                "SIZE {} outside [{min}, {max}], the sizes this file had in the window",
                fd.size
            ));
        }
        for f in &floors {
            let later = self.versions_in(id, f.at, w.hi);
            let need = later
                .iter()
                .map(|v| v.len() as u64)
                .min()
                .unwrap_or(0)
                .min(f.to);
            if fd.size < need {
                return Err(format!(
                    "DURABILITY: size {} < {need} needed by the DSYNC write [{}, {}) that returned at boundary {}",
                    fd.size, f.from, f.to, f.at
                ));
            }
        }
        if fd.data.len() as u64 != fd.size {
            return Err(format!("read {} bytes, size {}", fd.data.len(), fd.size));
        }
        // Bytes, 512 at a time; a chunk matching one allowed version whole is
        // fine, otherwise byte by byte with each byte's own floor.
        let byte_at = |v: &Vec<u8>, x: usize| v.get(x).copied().unwrap_or(0);
        const CHUNK: usize = 512;
        let data = &fd.data;
        let mut c = 0;
        while c < data.len() {
            let end = (c + CHUNK).min(data.len());
            let floor_chunk = floors
                .iter()
                .filter(|f| f.from < end as u64 && f.to > c as u64)
                .map(|f| f.at)
                .max()
                .unwrap_or(w.lo)
                .max(w.lo);
            let strict = self.versions_in(id, floor_chunk, w.hi);
            let whole = strict.iter().any(|v| {
                if v.len() >= end {
                    v[c..end] == data[c..end]
                } else {
                    (c..end).all(|x| byte_at(v, x) == data[x])
                }
            });
            if !whole {
                for x in c..end {
                    let fl = floors
                        .iter()
                        .filter(|f| f.from <= x as u64 && (x as u64) < f.to)
                        .map(|f| f.at)
                        .max()
                        .unwrap_or(w.lo)
                        .max(w.lo);
                    let allowed = self.versions_in(id, fl, w.hi);
                    if !allowed.iter().any(|v| byte_at(v, x) == data[x]) {
                        let vals: Vec<String> = allowed
                            .iter()
                            .map(|v| format!("{:02x}", byte_at(v, x)))
                            .collect();
                        let kind = if fl > w.lo {
                            "DURABILITY (DSYNC write lost)"
                        } else if allowed.len() == 1 {
                            "DURABILITY/STALE (file was synced and unchanged)"
                        } else {
                            "STALE/ATTRIBUTION"
                        };
                        return Err(format!(
                            "{kind}: byte at offset {x} is {:02x}, allowed {{{}}} from {} version(s) since boundary {fl}; got {} (from {}); newest version {}",
                            data[x],
                            vals.join(","),
                            allowed.len(),
                            super::excerpt(data, x),
                            attribute(data, x, self.max_wid),
                            super::excerpt(allowed.last().unwrap(), x),
                        ));
                    }
                }
            }
            c = end;
        }
        Ok(())
    }
}

pub fn find_marker(data: &[u8]) -> Option<usize> {
    if data.len() < MARKER.len() {
        return None;
    }
    let mut i = 0;
    while i + MARKER.len() <= data.len() {
        match data[i..].iter().position(|&b| b == MARKER[0]) {
            None => return None,
            Some(p) => {
                let at = i + p;
                if at + MARKER.len() <= data.len() && &data[at..at + MARKER.len()] == MARKER {
                    return Some(at);
                }
                i = at + 1;
            }
        }
    }
    None
}

/// The bytes write `wid` puts at file offsets `[off, off + len)`: an 8-byte
/// tag of the write, repeated in step with the file offset, never zero, so any
/// byte read back can be attributed to the write (and the offset) it came from.
pub fn tagged(wid: u64, off: u64, len: usize) -> Vec<u8> {
    let tag = tag_of(wid);
    (0..len as u64)
        .map(|i| tag[((off + i) % 8) as usize])
        .collect()
}

pub fn tag_of(wid: u64) -> [u8; 8] {
    let mut t = super::mix64(wid ^ 0x7A6_0000_0000).to_le_bytes();
    for b in &mut t {
        if *b == 0 {
            *b = 0x5A;
        }
    }
    t
}

/// Which write (id up to `max_wid`) put the 8 bytes at file offset `at`
/// (tags repeat in step with the file offset), for failure messages.
pub fn attribute(data: &[u8], at: usize, max_wid: u64) -> String {
    if at + 8 > data.len() {
        return "?".into();
    }
    if data[at..at + 8] == *MARKER {
        return "the device fill marker (stale)".into();
    }
    if data[at..at + 8].iter().all(|&b| b == 0) {
        return "zeros".into();
    }
    for wid in 1..=max_wid {
        if tagged(wid, at as u64, 8) == data[at..at + 8] {
            return format!("write w{wid}");
        }
    }
    "no known write".into()
}
