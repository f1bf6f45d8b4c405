//! Every kind of inode the volume can hold reaches C as an
//! `IOMAPFS_KIND_*` (a volume the mount has used holds symlinks and special
//! files, which this API lists and stats but does not make).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::Arc;

use iomapfs::*;
use iomapfs_fs::{FileKind, FormatOptions, NewNode, OpenFlags, Volume};

unsafe extern "C" fn collect(ctx: *mut c_void, name: *const c_char, _ino: u64, kind: u32) -> c_int {
    // SAFETY: `ctx` is the Vec passed below; `name` is valid during the
    // call, per the API.
    let seen = unsafe { &mut *ctx.cast::<Vec<(String, u32)>>() };
    let name = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    seen.push((name, kind));
    0
}

#[test]
fn readdir_and_stat_name_every_kind() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("vol.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    {
        let (dev, _) = blockdev::open_device(&image, false, blockdev::Backend::Sync).unwrap();
        Volume::format(Arc::clone(&dev), &FormatOptions::default()).unwrap();
        let vol = Volume::open(dev).unwrap();
        vol.mkdir("/d").unwrap();
        let create = OpenFlags {
            create: true,
            ..OpenFlags::default()
        };
        drop(vol.open_file("/d/file", create).unwrap());
        vol.mkdir("/d/sub").unwrap();
        vol.symlink("file", "/d/link").unwrap();
        let d = vol.ino_of("/d").unwrap();
        for (name, kind) in [
            ("fifo", FileKind::Fifo),
            ("sock", FileKind::Socket),
            ("chr", FileKind::CharDevice),
            ("blk", FileKind::BlockDevice),
        ] {
            vol.make_node(d, name, NewNode::owned_by_process(kind), &[])
                .unwrap();
        }
        vol.unmount().unwrap();
    }
    let path = CString::new(image.to_str().unwrap()).unwrap();
    let mut vol = std::ptr::null_mut();
    // SAFETY: valid C strings and out pointers for the calls' duration.
    unsafe {
        assert_eq!(
            iomapfs_volume_open(path.as_ptr(), std::ptr::null(), &mut vol),
            0
        );
        let mut seen: Vec<(String, u32)> = Vec::new();
        let d = CString::new("/d").unwrap();
        let ctx = (&mut seen as *mut Vec<(String, u32)>).cast::<c_void>();
        assert_eq!(iomapfs_readdir(vol, d.as_ptr(), Some(collect), ctx), 0);
        let want: Vec<(String, u32)> = [
            ("blk", IOMAPFS_KIND_SPECIAL),
            ("chr", IOMAPFS_KIND_SPECIAL),
            ("fifo", IOMAPFS_KIND_SPECIAL),
            ("file", IOMAPFS_KIND_REGULAR),
            ("link", IOMAPFS_KIND_SYMLINK),
            ("sock", IOMAPFS_KIND_SPECIAL),
            ("sub", IOMAPFS_KIND_DIRECTORY),
        ]
        .map(|(n, k)| (n.to_string(), k))
        .into();
        assert_eq!(seen, want);
        let mut st = iomapfs_stat::default();
        let link = CString::new("/d/link").unwrap();
        assert_eq!(iomapfs_path_stat(vol, link.as_ptr(), &mut st), 0);
        assert_eq!(st.kind, IOMAPFS_KIND_SYMLINK);
        assert_eq!(st.size, 4, "a symlink's size is its target's length");
        assert_eq!(iomapfs_volume_close(vol), 0);
    }
}
