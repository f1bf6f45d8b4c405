//! Reading a whole volume back into plain data: every directory, every file's
//! size and bytes, through the public API only.

use std::collections::{BTreeMap, BTreeSet};

use iomapfs_fs::{FileKind, OpenFlags, Volume};

/// What a volume holds, as plain data.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VolState {
    /// Every directory except the root, as absolute paths.
    pub dirs: BTreeSet<String>,
    /// Every regular file: path -> contents (exactly `size` bytes, unless the
    /// file is larger than the read cap, then a prefix).
    pub files: BTreeMap<String, FileData>,
    /// Every symlink: path -> target.
    pub symlinks: BTreeMap<String, String>,
    /// FIFOs, sockets and device nodes: path -> kind.
    pub specials: BTreeMap<String, FileKind>,
    /// Every regular file's inode and attributes: path -> what `stat` and
    /// the xattr calls say (two names of one inode share `ino`).
    pub attrs: BTreeMap<String, FileAttrs>,
}

/// What format version 2 keeps of a file besides its bytes (the times
/// move with every write, so they are not compared).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FileAttrs {
    pub ino: u64,
    pub nlink: u32,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub xattrs: BTreeMap<String, Vec<u8>>,
}

/// The attributes of the regular file at `path`.
pub fn read_attrs(vol: &Volume, path: &str) -> Result<FileAttrs, String> {
    let st = vol.stat(path).map_err(|e| format!("stat({path}): {e}"))?;
    let mut xattrs = BTreeMap::new();
    let names = vol
        .list_xattr(st.ino)
        .map_err(|e| format!("listxattr({path}): {e}"))?;
    for name in names {
        let value = vol
            .get_xattr(st.ino, &name)
            .map_err(|e| format!("getxattr({path}, {name}): {e}"))?;
        xattrs.insert(name, value);
    }
    Ok(FileAttrs {
        ino: st.ino,
        nlink: st.nlink,
        mode: st.mode,
        uid: st.uid,
        gid: st.gid,
        xattrs,
    })
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FileData {
    pub size: u64,
    pub data: Vec<u8>,
}

pub fn join(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

pub fn parent_of(path: &str) -> &str {
    match path.rfind('/') {
        Some(0) | None => "/",
        Some(i) => &path[..i],
    }
}

pub fn ro() -> OpenFlags {
    OpenFlags {
        read_only: true,
        ..OpenFlags::default()
    }
}

/// Reads the whole tree. `cap` bounds the bytes read per file (hostile images
/// may claim huge sizes); `Err` says which call failed on which path.
pub fn read_volume(vol: &Volume, cap: u64) -> Result<VolState, String> {
    let mut st = VolState::default();
    let mut todo = vec!["/".to_string()];
    let mut visited = 0usize;
    while let Some(dir) = todo.pop() {
        visited += 1;
        if visited > 100_000 {
            return Err("more than 100000 directories: a cycle?".into());
        }
        let entries = vol
            .readdir(&dir)
            .map_err(|e| format!("readdir({dir}): {e}"))?;
        let mut seen = BTreeSet::new();
        for e in entries {
            if !seen.insert(e.name.clone()) {
                return Err(format!("readdir({dir}): duplicate name {:?}", e.name));
            }
            let path = join(&dir, &e.name);
            match e.kind {
                FileKind::Directory => {
                    if !st.dirs.insert(path.clone()) {
                        return Err(format!("{path}: directory seen twice (cycle?)"));
                    }
                    todo.push(path);
                }
                FileKind::Regular => {
                    let fd = read_file(vol, &path, cap)?;
                    st.attrs.insert(path.clone(), read_attrs(vol, &path)?);
                    st.files.insert(path, fd);
                }
                FileKind::Symlink => {
                    let target = vol
                        .readlink(&path)
                        .map_err(|e| format!("readlink({path}): {e}"))?;
                    st.symlinks
                        .insert(path, String::from_utf8_lossy(&target).into_owned());
                }
                other => {
                    st.specials.insert(path, other);
                }
            }
        }
    }
    Ok(st)
}

/// Reads one file whole (up to `cap` bytes) and checks EOF behaviour: a read
/// at EOF returns 0, a read across EOF is short, and `stat` agrees with the
/// handle's `stat`.
pub fn read_file(vol: &Volume, path: &str, cap: u64) -> Result<FileData, String> {
    let f = vol
        .open_file(path, ro())
        .map_err(|e| format!("open({path}): {e}"))?;
    let st = f.stat().map_err(|e| format!("stat({path}): {e}"))?;
    let st2 = vol
        .stat(path)
        .map_err(|e| format!("stat path({path}): {e}"))?;
    if st.size != st2.size || st.ino != st2.ino {
        return Err(format!(
            "{path}: handle stat (ino {} size {}) != path stat (ino {} size {})",
            st.ino, st.size, st2.ino, st2.size
        ));
    }
    if st.kind != FileKind::Regular {
        return Err(format!(
            "{path}: stat kind {:?} for a regular file",
            st.kind
        ));
    }
    let want = st.size.min(cap) as usize;
    let mut data = vec![0u8; want];
    let mut done = 0usize;
    // One read must return everything inside EOF: short reads only at EOF.
    while done < want {
        let n = f
            .pread(&mut data[done..], done as u64)
            .map_err(|e| format!("pread({path}, off {done}, len {}): {e}", want - done))?;
        if n == 0 {
            return Err(format!(
                "{path}: pread at {done} returned 0 inside EOF (size {})",
                st.size
            ));
        }
        if n != want - done {
            return Err(format!(
                "{path}: short read inside EOF: pread(off {done}, len {}) returned {n} (size {})",
                want - done,
                st.size
            ));
        }
        done += n;
    }
    if st.size <= cap {
        let mut tail = [0xAAu8; 700];
        let n = f
            .pread(&mut tail, st.size)
            .map_err(|e| format!("pread({path}) at EOF {}: {e}", st.size))?;
        if n != 0 {
            return Err(format!("{path}: pread at EOF {} returned {n}", st.size));
        }
        if st.size > 0 {
            let back = (st.size % 700).max(1).min(st.size);
            let n = f
                .pread(&mut tail, st.size - back)
                .map_err(|e| format!("pread({path}) across EOF: {e}"))?;
            if n as u64 != back {
                return Err(format!(
                    "{path}: pread of 700 at {} (size {}) returned {n}, want {back}",
                    st.size - back,
                    st.size
                ));
            }
            if tail[..n] != data[(st.size - back) as usize..] {
                return Err(format!("{path}: read across EOF differs from a whole read"));
            }
        }
    }
    Ok(FileData {
        size: st.size,
        data,
    })
}
