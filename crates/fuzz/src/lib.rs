//! Fuzz targets for the code that reads untrusted bytes (invariant 6: bad
//! input gives a clear error, never a panic, hang or undefined behaviour).
//!
//! Each target is a plain function of the input bytes, so the same code
//! runs under libFuzzer (`fuzz_targets/`, feature `libfuzzer`) and, for
//! every file of the seed corpus and of the regressions, as an ordinary
//! test (`tests/corpus.rs`). A target panics only for a bug.
//!
//! Checksums would stop a fuzzer at the first byte it changes, so the
//! targets seal their input the way the writer would (the superblock crc,
//! a journal batch's crcs and chain, a checkpoint written through the
//! library's own encoder): what gets fuzzed is the decoding and validation
//! behind them.
//!
//! - [`superblock`]: `Superblock::decode`; a decoded superblock re-encodes
//!   to the same bytes, its regions lie inside the device and (with the
//!   backup superblock feature) leave the device's last block free.
//! - [`checkpoint_image`]: `decode_image`, then loading and validating the
//!   image (`MetaState::from_image`, link and kind checks); a decoded image
//!   re-encodes and decodes to itself.
//! - [`checkpoint_delta`]: `decode_delta_at` (the payload after its link);
//!   a decoded delta re-encodes to itself; then, linked to a real volume's
//!   chain and written after it, fsck, mount and use the volume.
//! - [`journal_records`]: one batch of fuzzed records replayed after a real
//!   checkpoint, applied to its state.
//! - [`mount`]: a fuzzed checkpoint image and journal batch on a formatted
//!   device; fsck, mount, read every file, write, fsync, unmount, fsck.
//! - [`extent_pages`]: `decode_root_at` and `decode_indexed_root_at` of
//!   the same bytes (a root of either form round-trips, its pages or index
//!   pages lie in the data area, no file keeps more extents inline than a
//!   block holds), `decode_page` of one page sealed with its crc (a page
//!   re-encodes to itself) and `decode_index_page` of the same bytes
//!   sealed as an index page (it re-encodes to itself and its reference).

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};

use blockdev::{BlockDevice, MemDevice, Survival, WriteMode};
use iomapfs_fs::checkpoint::{
    read_checkpoints, read_newest_checkpoint, write_checkpoint, write_delta, Checkpoint,
    DeltaCheckpoint,
};
use iomapfs_fs::codec::{
    decode_delta_at, decode_image, encode_delta, encode_image, DeltaLink, DELTA_LINK_ENCODED_LEN,
};
use iomapfs_fs::journal::{encode_batch, replay, LaterBatches};
use iomapfs_fs::state::MetaState;
use iomapfs_fs::superblock::{
    read_superblock, Superblock, COMPAT_BACKUP_SUPERBLOCK, OFF_CRC, SUPERBLOCK_ENCODED_LEN,
};
use iomapfs_fs::{fsck, Error, FileKind, FormatOptions, OpenFlags, Volume};

/// Device of the targets that need a volume: small, so each run is cheap.
pub const DEVICE_BYTES: u64 = 4 << 20;
const LBS: u32 = 512;
/// Bytes read per file from a fuzzed volume (sizes may be absurd).
const READ_CAP: usize = 1 << 20;
/// Directories walked per fuzzed volume (a cycle must not make it spin).
const MAX_DIRS: usize = 256;

/// `superblock`: decode, and round-trip what decodes.
pub fn superblock(data: &[u8]) {
    let mut buf = data.to_vec();
    if buf.len() >= SUPERBLOCK_ENCODED_LEN {
        let crc = crc32c::crc32c(&buf[..OFF_CRC]);
        buf[OFF_CRC..OFF_CRC + 4].copy_from_slice(&crc.to_le_bytes());
    }
    let Ok(sb) = Superblock::decode(&buf) else {
        return;
    };
    let again = sb.encode();
    assert_eq!(
        &again[..SUPERBLOCK_ENCODED_LEN],
        &buf[..SUPERBLOCK_ENCODED_LEN],
        "a decoded superblock does not re-encode to its bytes"
    );
    let l = &sb.layout;
    for r in [
        l.checkpoint_slots[0],
        l.checkpoint_slots[1],
        l.journal,
        l.data,
    ] {
        assert!(
            r.start
                .checked_add(r.len)
                .is_some_and(|e| e <= l.device_bytes),
            "region {r:?} outside the {}-byte device was accepted",
            l.device_bytes
        );
    }
    if sb.features_compat & COMPAT_BACKUP_SUPERBLOCK != 0 {
        assert!(
            l.leaves_room_for_backup(),
            "a layout whose regions cover the backup superblock was accepted"
        );
    }
}

/// `checkpoint_image`: decode, round-trip, load and validate.
pub fn checkpoint_image(data: &[u8]) {
    let Ok(image) = decode_image(data) else {
        return;
    };
    let bytes = encode_image(&image).expect("a decoded image encodes");
    assert_eq!(
        decode_image(&bytes).expect("a re-encoded image decodes"),
        image,
        "a decoded image does not round-trip"
    );
    for block_size in [512, 4096] {
        if let Ok(state) = MetaState::from_image(&image, block_size) {
            let _ = state.check_links_and_kinds();
            let _ = state.to_image();
        }
    }
}

/// `checkpoint_delta`: a delta payload without its link (generation and
/// crc of the record before it, which the target fills in so that the
/// delta links to the base volume's chain).
pub fn checkpoint_delta(data: &[u8]) {
    let mut payload = vec![0u8; DELTA_LINK_ENCODED_LEN];
    payload.extend_from_slice(data);
    let Ok((_, delta)) = decode_delta_at(&payload, 0) else {
        return;
    };
    let dev = device_from(base_volume());
    let sb = read_superblock(&*dev).expect("base superblock");
    let newest = read_checkpoints(&*dev, &sb).expect("base checkpoint");
    let link = DeltaLink {
        prev_generation: newest.chain.generation,
        prev_crc: newest.chain.crc,
    };
    let bytes = encode_delta(link, &delta).expect("a decoded delta encodes");
    // Equal as values, not bytes: a decoder skips attribute bytes a later
    // format appends (forward compatibility), which the encoder does not
    // write back.
    let (_, again) = decode_delta_at(&bytes, 0).expect("an encoded delta decodes");
    assert_eq!(again, delta, "a decoded delta does not round-trip");
    let ckpt = &newest.checkpoint;
    let written = DeltaCheckpoint {
        generation: ckpt.generation + 1,
        journal_start: ckpt.journal_start,
        journal_seq: ckpt.journal_seq,
        journal_chain: ckpt.journal_chain,
        delta,
    };
    // One too large for the slot is skipped.
    if write_delta(&*dev, &sb, newest.slot, &newest.chain, &written, &[]).is_ok() {
        exercise(dev);
    }
}

/// A formatted volume with files, directories, extents of both kinds and a
/// checkpoint, made once per process.
fn base_volume() -> &'static MemDevice {
    static BASE: OnceLock<MemDevice> = OnceLock::new();
    BASE.get_or_init(|| {
        let mem = Arc::new(MemDevice::new(DEVICE_BYTES, LBS));
        let dev: Arc<dyn BlockDevice> = mem.clone();
        Volume::format(dev.clone(), &FormatOptions::default()).expect("format");
        let vol = Volume::open(dev).expect("mount");
        vol.mkdir("/d").expect("mkdir");
        let create = OpenFlags {
            create: true,
            ..OpenFlags::default()
        };
        for (i, path) in ["/a", "/d/b", "/c"].iter().enumerate() {
            let f = vol.open_file(path, create).expect("create");
            f.pwrite(&vec![i as u8 + 1; 5000 + 3000 * i], 0)
                .expect("write");
            if i == 1 {
                f.fallocate(20_000, 9000, false).expect("fallocate");
            }
        }
        vol.unmount().expect("unmount");
        mem.power_cut(&mut |_| Survival::Kept)
    })
}

/// A copy of `base` to change (copy-on-write: cheap).
fn device_from(base: &MemDevice) -> Arc<MemDevice> {
    Arc::new(base.power_cut(&mut |_| Survival::Kept))
}

/// Splits `data` into a record count and an encoded payload.
fn count_and_payload(data: &[u8]) -> Option<(u32, &[u8])> {
    let (&count, payload) = data.split_first()?;
    Some((u32::from(count).max(1), payload))
}

/// Appends one batch of `payload` (claiming `count` records) after the
/// newest checkpoint of `dev`, valid in every crc and chain.
fn append_raw_batch(
    dev: &MemDevice,
    sb: &Superblock,
    ckpt: &Checkpoint,
    count: u32,
    payload: &[u8],
) -> bool {
    let (batch, _) = encode_batch(
        sb.crc_seed(),
        ckpt.journal_seq,
        count,
        ckpt.journal_chain,
        payload,
        sb.block_size(),
    );
    if ckpt.journal_start + batch.len() as u64 > sb.layout.journal.len {
        return false;
    }
    dev.write_at(
        &batch,
        sb.layout.journal.start + ckpt.journal_start,
        WriteMode::Normal,
    )
    .and_then(|()| dev.flush())
    .is_ok()
}

/// `journal_records`: `data[0]` records claimed, `data[1..]` their encoding.
pub fn journal_records(data: &[u8]) {
    let Some((count, payload)) = count_and_payload(data) else {
        return;
    };
    let dev = device_from(base_volume());
    let sb = read_superblock(&*dev).expect("base superblock");
    let (_, ckpt) = read_newest_checkpoint(&*dev, &sb).expect("base checkpoint");
    if !append_raw_batch(&dev, &sb, &ckpt, count, payload) {
        return;
    }
    let mut state = MetaState::from_image(&ckpt.image, sb.layout.block_size).expect("base image");
    let mut freed = Vec::new();
    let _ = replay(
        &*dev,
        &sb,
        ckpt.journal_start,
        ckpt.journal_seq,
        ckpt.journal_chain,
        LaterBatches::Scan,
        &mut |_, record| {
            state
                .apply(&record, &mut freed)
                .map_err(|reason| Error::invalid("fuzzed record", reason))
        },
    );
}

/// `spill_table`: the payload of a spilled checkpoint base, checked
/// against the base volume's layout. A table that decodes lists disjoint,
/// aligned extents of the data area holding exactly the image's blocks,
/// and encodes back to the same bytes.
pub fn spill_table(data: &[u8]) {
    use iomapfs_fs::checkpoint::{decode_spill_table, encode_spill_table, spill_bytes};
    let sb = read_superblock(base_volume()).expect("base superblock");
    let Ok(table) = decode_spill_table(&sb, data, 0) else {
        return;
    };
    let area = sb.layout.data;
    let bs = u64::from(sb.layout.block_size);
    let mut sorted = table.extents.clone();
    sorted.sort_unstable();
    let mut total = 0u64;
    for (i, &(addr, len)) in sorted.iter().enumerate() {
        assert!(len > 0 && addr >= area.start && addr + len <= area.start + area.len);
        assert!(addr % bs == 0 && len % bs == 0, "unaligned");
        assert!(
            i == 0 || sorted[i - 1].0 + sorted[i - 1].1 <= addr,
            "overlap"
        );
        total += len;
    }
    assert_eq!(total, spill_bytes(&sb, table.image_len));
    assert_eq!(encode_spill_table(&table), data);
}

/// `extent_pages`: `[root length: u32 LE][root][one page]`. The root is
/// read in both forms. The page is read both as an extent page and as an
/// index page, each sealed as the writer would (its crc, and a reference
/// naming what its header says and what its contents sum to).
pub fn extent_pages(data: &[u8]) {
    use iomapfs_fs::codec::{
        decode_indexed_root_at, decode_page, decode_root_at, encode_indexed_root_after,
        encode_page, encode_root_after, page_len, PageArea, PageRef, PAGE_HEADER_LEN,
    };
    let sb = read_superblock(base_volume()).expect("base superblock");
    let bs = u64::from(sb.layout.block_size);
    let area = PageArea {
        start: sb.layout.data.start,
        len: sb.layout.data.len,
        block_size: bs,
    };
    let in_area = |addr: u64, len: u64| {
        addr >= area.start && addr + len <= area.start + area.len && addr.is_multiple_of(bs)
    };
    let inline_max = iomapfs_fs::codec::inline_extents_max(bs);
    let (root_len, rest) = match data.split_first_chunk::<4>() {
        Some((len, rest)) => (u32::from_le_bytes(*len) as usize, rest),
        None => (0, data),
    };
    let (root, page) = rest.split_at(root_len.min(rest.len()));
    if let Ok(decoded) = decode_root_at(root, 0, "root", area) {
        for p in decoded.pages.iter().flat_map(|(_, list)| list.iter()) {
            assert!(in_area(p.addr, page_len(p.count as usize, bs)));
        }
        assert!(decoded
            .image
            .inodes
            .iter()
            .all(|i| i.extents.len() <= inline_max));
        round_trips(
            &decoded,
            |root| {
                let heads: Vec<_> = root.image.inodes.iter().collect();
                encode_root_after(0, root.image.next_ino, &heads, &root.pages, bs)
                    .expect("a decoded root encodes")
            },
            |bytes| decode_root_at(bytes, 0, "root", area),
        );
    }
    if let Ok(decoded) = decode_indexed_root_at(root, 0, "root", area) {
        for r in decoded.index.iter().flat_map(|(_, list)| list.iter()) {
            assert!(in_area(r.addr, bs), "an index page outside the data area");
        }
        assert!(decoded
            .image
            .inodes
            .iter()
            .all(|i| i.extents.len() <= inline_max));
        round_trips(
            &decoded,
            |root| {
                let heads: Vec<_> = root.image.inodes.iter().collect();
                encode_indexed_root_after(0, root.image.next_ino, &heads, &root.index, bs)
                    .expect("a decoded indexed root encodes")
            },
            |bytes| decode_indexed_root_at(bytes, 0, "root", area),
        );
    }
    let seed = sb.crc_seed();
    index_page(seed, page, area);
    if page.len() < PAGE_HEADER_LEN {
        return;
    }
    let mut page = page.to_vec();
    let field = |at: usize| u64::from_le_bytes(page[at..at + 8].try_into().unwrap());
    let (ino, first_key) = (field(8), field(16));
    let count = u32::from_le_bytes(page[24..28].try_into().unwrap());
    let extents = ((page.len() - PAGE_HEADER_LEN) / 25).min(count as usize);
    let allocated = (0..extents).fold(0u64, |sum, i| {
        sum.wrapping_add(field(PAGE_HEADER_LEN + 25 * i + 8))
    });
    let body = PAGE_HEADER_LEN + 25 * extents;
    let crc = crc32c::crc32c_append(
        crc32c::crc32c_append(seed, &page[..28]),
        &page[PAGE_HEADER_LEN..body],
    );
    page[28..32].copy_from_slice(&crc.to_le_bytes());
    let listed = PageRef {
        addr: 0,
        crc,
        count,
        first_key,
        allocated,
    };
    if let Ok(got) = decode_page(seed, &page, ino, &listed) {
        let (again, _) = encode_page(seed, ino, &got, bs, 0).expect("a decoded page encodes");
        assert_eq!(
            &again[..body],
            &page[..body],
            "a decoded page does not re-encode"
        );
    }
}

/// A decoded root encodes (with `encode`) to bytes that decode to it, and
/// those bytes are a fixed point. Not byte for byte the input: a decoder
/// skips attribute bytes a later format appends, and this build writes
/// the inode back without them.
fn round_trips<T: PartialEq + std::fmt::Debug>(
    decoded: &T,
    encode: impl Fn(&T) -> Vec<u8>,
    decode: impl Fn(&[u8]) -> iomapfs_fs::Result<T>,
) {
    let again = encode(decoded);
    let redecoded = decode(&again).expect("a re-encoded root decodes");
    assert_eq!(&redecoded, decoded, "a decoded root does not round-trip");
    assert_eq!(
        encode(&redecoded),
        again,
        "a written root is not a fixed point"
    );
}

/// `bytes` as an index page: sealed with its crc over the references its
/// header counts (as many as the bytes hold), listed by a reference that
/// names what its header says and what those references sum to. One that
/// decodes re-encodes to its bytes and to that reference. Says whether it
/// decoded.
fn index_page(seed: u32, bytes: &[u8], area: iomapfs_fs::codec::PageArea) -> bool {
    use iomapfs_fs::codec::{
        decode_index_page, encode_index_page, page_len, IndexRef, INDEX_HEADER_LEN,
        PAGE_REF_ENCODED_LEN,
    };
    if bytes.len() < INDEX_HEADER_LEN {
        return false;
    }
    let mut page = bytes.to_vec();
    let u64_at = |at: usize| u64::from_le_bytes(page[at..at + 8].try_into().unwrap());
    let u32_at = |at: usize| u32::from_le_bytes(page[at..at + 4].try_into().unwrap());
    let (ino, first_key, count) = (u64_at(8), u64_at(16), u32_at(24));
    let refs = ((page.len() - INDEX_HEADER_LEN) / PAGE_REF_ENCODED_LEN).min(count as usize);
    let (mut extents, mut allocated, mut page_bytes) = (0u64, 0u64, 0u64);
    for i in 0..refs {
        // A reference: address u64, crc u32, count u32, first key u64,
        // allocated u64.
        let at = INDEX_HEADER_LEN + PAGE_REF_ENCODED_LEN * i;
        let pages_extents = u32_at(at + 12);
        extents = extents.wrapping_add(u64::from(pages_extents));
        allocated = allocated.wrapping_add(u64_at(at + 24));
        page_bytes = page_bytes.wrapping_add(page_len(pages_extents as usize, area.block_size));
    }
    let body = INDEX_HEADER_LEN + PAGE_REF_ENCODED_LEN * refs;
    let crc = crc32c::crc32c_append(
        crc32c::crc32c_append(seed, &page[..28]),
        &page[INDEX_HEADER_LEN..body],
    );
    page[28..32].copy_from_slice(&crc.to_le_bytes());
    let listed = IndexRef {
        addr: area.start,
        copy: area.start + area.block_size,
        crc,
        pages: count,
        first_key,
        extents,
        allocated,
        page_bytes,
    };
    let Ok(got) = decode_index_page(seed, &page, ino, &listed, listed.addr, area) else {
        return false;
    };
    {
        let (again, index) = encode_index_page(seed, ino, &got, area.block_size, listed.blocks())
            .expect("a decoded index page encodes");
        assert_eq!(
            index, listed,
            "a decoded index page lists another reference"
        );
        assert_eq!(
            &again[..body],
            &page[..body],
            "a decoded index page does not re-encode"
        );
    }
    true
}

/// Inputs of [`extent_pages`] for the base volume's image: its root with
/// a page for every other file with extents (the rest inline), and the
/// first file's page; the same in the indexed form, with the first file's
/// index page.
fn page_seeds(
    sb: &iomapfs_fs::superblock::Superblock,
    image: &iomapfs_fs::types::MetaImage,
) -> Vec<Vec<u8>> {
    use iomapfs_fs::codec::{
        encode_index_page, encode_indexed_root_after, encode_page, encode_root_after,
    };
    let bs = u64::from(sb.layout.block_size);
    let mut addr = sb.layout.data.start;
    let mut table = Vec::new();
    let mut pages = Vec::new();
    let mut image = image.clone();
    for (n, inode) in image
        .inodes
        .iter_mut()
        .filter(|i| !i.extents.is_empty())
        .enumerate()
    {
        if n % 2 == 1 {
            continue;
        }
        let (bytes, page) =
            encode_page(sb.crc_seed(), inode.ino, &inode.extents, bs, addr).expect("page");
        addr += bytes.len() as u64;
        table.push((inode.ino, vec![page]));
        pages.push(bytes);
        inode.extents.clear();
    }
    let mut index = Vec::new();
    let mut index_pages = Vec::new();
    for (ino, list) in &table {
        let (bytes, r) =
            encode_index_page(sb.crc_seed(), *ino, list, bs, [addr, addr + bs]).expect("index");
        addr += 2 * bytes.len() as u64;
        index.push((*ino, vec![r]));
        index_pages.push(bytes);
    }
    let heads: Vec<_> = image.inodes.iter().collect();
    let input = |root: Vec<u8>, page: Option<&Vec<u8>>| {
        let mut input = (root.len() as u32).to_le_bytes().to_vec();
        input.extend_from_slice(&root);
        input.extend_from_slice(page.map_or(&[][..], |p| &p[..]));
        input
    };
    let listed: iomapfs_fs::codec::PageTable = table
        .iter()
        .map(|(ino, list)| (*ino, list.clone().into()))
        .collect();
    let root = encode_root_after(0, image.next_ino, &heads, &listed, bs).expect("root");
    let indexed =
        encode_indexed_root_after(0, image.next_ino, &heads, &index, bs).expect("indexed root");
    vec![
        input(root.clone(), None),
        input(root, pages.first()),
        input(indexed, index_pages.first()),
    ]
}

/// `mount`: `[image length: u32 LE][checkpoint image][record count][records]`.
/// An input whose image does not decode keeps the base checkpoint.
pub fn mount(data: &[u8]) {
    let dev = device_from(base_volume());
    let sb = read_superblock(&*dev).expect("base superblock");
    let (slot, mut ckpt) = read_newest_checkpoint(&*dev, &sb).expect("base checkpoint");
    let (image_len, rest) = match data.split_first_chunk::<4>() {
        Some((len, rest)) => (u32::from_le_bytes(*len) as usize, rest),
        None => (0, data),
    };
    let (image_bytes, journal) = rest.split_at(image_len.min(rest.len()));
    if let Ok(image) = decode_image(image_bytes) {
        ckpt.generation += 1;
        ckpt.image = image;
        // A new checkpoint in the other slot; one too large is skipped.
        let _ = write_checkpoint(&*dev, &sb, 1 - slot, &ckpt);
    }
    let (_, ckpt) = read_newest_checkpoint(&*dev, &sb).expect("a checkpoint");
    if let Some((count, payload)) = count_and_payload(journal) {
        append_raw_batch(&dev, &sb, &ckpt, count, payload);
    }
    exercise(dev);
}

/// fsck, mount, read everything, write, fsync, unmount, fsck again. Errors
/// are fine and must say something; a volume fsck calls clean must stay
/// clean through the operations.
fn exercise(dev: Arc<MemDevice>) {
    let dyn_dev: Arc<dyn BlockDevice> = dev.clone();
    let clean_before = match fsck::check(dyn_dev.clone()) {
        Ok(report) => report.is_clean(),
        Err(e) => {
            assert!(!e.to_string().is_empty(), "fsck error without a message");
            false
        }
    };
    let vol = match Volume::open(dyn_dev.clone()) {
        Ok(vol) => vol,
        Err(e) => {
            assert!(!e.to_string().is_empty(), "mount error without a message");
            return;
        }
    };
    let mut dirs = VecDeque::from(["/".to_string()]);
    let mut visited = 0;
    while let Some(dir) = dirs.pop_front() {
        visited += 1;
        if visited > MAX_DIRS {
            break;
        }
        let Ok(entries) = vol.readdir(&dir) else {
            continue;
        };
        for e in entries {
            let path = if dir == "/" {
                format!("/{}", e.name)
            } else {
                format!("{dir}/{}", e.name)
            };
            match e.kind {
                FileKind::Directory => dirs.push_back(path.clone()),
                FileKind::Regular => {
                    if let Ok(f) = vol.open_file(&path, OpenFlags::default()) {
                        let mut buf = vec![0u8; READ_CAP.min(64 * 1024)];
                        let mut off = 0u64;
                        while (off as usize) < READ_CAP {
                            match f.pread(&mut buf, off) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => off += n as u64,
                            }
                        }
                        let _ = f.pwrite(&[0x5a; 3000], 1000);
                    }
                }
                FileKind::Symlink => {
                    let _ = vol.readlink(&path);
                }
                _ => {
                    let _ = vol.stat(&path);
                }
            }
            if let Ok(ino) = vol.ino_of(&path) {
                let _ = vol.stat_ino(ino);
                for name in vol.list_xattr(ino).unwrap_or_default() {
                    let _ = vol.get_xattr(ino, &name);
                }
            }
        }
    }
    let create = OpenFlags {
        create: true,
        ..OpenFlags::default()
    };
    if let Ok(f) = vol.open_file("/fuzz-new", create) {
        let _ = f.pwrite(&[7u8; 9000], 0);
        let _ = f.fsync();
    }
    let unmounted = vol.unmount();
    if clean_before && unmounted.is_ok() {
        let after = fsck::check(dyn_dev).expect("fsck after a clean volume was used");
        assert!(
            after.is_clean(),
            "a volume fsck called clean is not clean after reads, writes and an unmount: {:?}",
            after.problems
        );
    }
}

/// A fuzz target: the input bytes in, a panic only for a bug.
pub type Target = fn(&[u8]);

/// The targets by name, for the corpus tests and the corpus generator.
pub const TARGETS: [(&str, Target); 7] = [
    ("superblock", superblock),
    ("checkpoint_image", checkpoint_image),
    ("checkpoint_delta", checkpoint_delta),
    ("spill_table", spill_table),
    ("journal_records", journal_records),
    ("mount", mount),
    ("extent_pages", extent_pages),
];

/// Seed inputs for each target, made from a real volume: a superblock, the
/// checkpoint image, records of every kind, and mount inputs built from
/// them. `tests/corpus.rs` checks the committed corpus holds them.
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    let dev = device_from(base_volume());
    let sb = read_superblock(&*dev).expect("base superblock");
    let (_, ckpt) = read_newest_checkpoint(&*dev, &sb).expect("base checkpoint");
    let image = encode_image(&ckpt.image).expect("encode");
    let records = record_seeds();
    match target {
        "superblock" => vec![sb.encode()[..SUPERBLOCK_ENCODED_LEN].to_vec()],
        "checkpoint_image" => vec![image],
        "checkpoint_delta" => delta_seeds(&ckpt.image),
        "spill_table" => spill_seeds(&sb, image.len() as u64),
        "extent_pages" => page_seeds(&sb, &ckpt.image),
        "journal_records" => records,
        "mount" => {
            let mut out = vec![Vec::new()];
            let mut with_image = (image.len() as u32).to_le_bytes().to_vec();
            with_image.extend_from_slice(&image);
            out.push(with_image.clone());
            for r in records {
                let mut input = with_image.clone();
                input.extend_from_slice(&r);
                out.push(input);
            }
            out
        }
        other => panic!("no target named {other}"),
    }
}

/// Delta payloads (without the link) for the base volume: a file's size
/// and extents changed in one span, a file removed, a file added.
fn delta_seeds(image: &iomapfs_fs::types::MetaImage) -> Vec<Vec<u8>> {
    use iomapfs_fs::types::{InodeDelta, MetaDelta};
    let link = DeltaLink {
        prev_generation: 0,
        prev_crc: 0,
    };
    let file = image
        .inodes
        .iter()
        .find(|i| i.kind == FileKind::Regular && !i.extents.is_empty())
        .expect("a file with extents");
    let mut changed = file.clone();
    changed.size += 1;
    let first = changed.extents[0].file_off;
    changed.extents.truncate(1);
    let deltas = [
        MetaDelta {
            next_ino: image.next_ino,
            removed: Vec::new(),
            changed: vec![InodeDelta {
                spans: vec![(first, first + 1)],
                inode: changed,
            }],
        },
        MetaDelta {
            next_ino: image.next_ino,
            removed: vec![file.ino],
            changed: Vec::new(),
        },
        MetaDelta {
            next_ino: image.next_ino + 1,
            removed: Vec::new(),
            changed: vec![InodeDelta {
                spans: vec![(0, u64::MAX)],
                inode: iomapfs_fs::types::InodeImage {
                    ino: image.next_ino,
                    ..file.clone()
                },
            }],
        },
    ];
    deltas
        .iter()
        .map(|d| encode_delta(link, d).expect("seed delta")[DELTA_LINK_ENCODED_LEN..].to_vec())
        .collect()
}

/// One encoded batch payload per record kind, prefixed by its count.
fn record_seeds() -> Vec<Vec<u8>> {
    use iomapfs_fs::codec::{encode_record, Encoder};
    use iomapfs_fs::types::{InodeAttrs, Record, Timestamp};
    let time = Timestamp { sec: 1, nsec: 2 };
    let records = [
        Record::Create {
            ino: 100,
            parent: 1,
            name: "n".into(),
            kind: FileKind::Regular,
            attrs: InodeAttrs::default(),
            target: Vec::new(),
        },
        Record::Create {
            ino: 101,
            parent: 1,
            name: "s".into(),
            kind: FileKind::Symlink,
            attrs: InodeAttrs::default(),
            target: b"/a".to_vec(),
        },
        Record::Unlink {
            parent: 1,
            name: "a".into(),
            time,
        },
        Record::Rename {
            src_parent: 1,
            src_name: "c".into(),
            dst_parent: 1,
            dst_name: "e".into(),
            exchange: false,
            time,
        },
        Record::Link {
            ino: 2,
            parent: 1,
            name: "h".into(),
            time,
        },
        Record::SetAttr {
            ino: 2,
            mode: 0o640,
            uid: 7,
            gid: 8,
            atime: time,
            mtime: time,
            ctime: time,
        },
        Record::SetXattr {
            ino: 2,
            name: "user.k".into(),
            value: b"v".to_vec(),
            ctime: time,
        },
        Record::RemoveXattr {
            ino: 2,
            name: "user.k".into(),
            ctime: time,
        },
        Record::MapUnwritten {
            ino: 2,
            file_off: 1 << 20,
            len: 4096,
            addr: 3 << 20,
        },
        Record::CompleteWrite {
            ino: 2,
            file_off: 0,
            len: 4096,
            min_size: 9000,
            mtime_ns: 2,
        },
        Record::SetSize {
            ino: 2,
            size: 100,
            mtime_ns: 3,
        },
        Record::Punch {
            ino: 2,
            file_off: 0,
            len: 4096,
            mtime_ns: 4,
        },
        Record::FreeInode { ino: 2 },
    ];
    records
        .iter()
        .map(|r| {
            let mut enc = Encoder::new();
            encode_record(r, &mut enc).expect("encode a seed record");
            let mut out = vec![1u8];
            out.extend_from_slice(enc.as_bytes());
            out
        })
        .collect()
}

/// Spill tables valid for the base volume: the image in one extent, and
/// five blocks in two extents out of address order.
fn spill_seeds(sb: &iomapfs_fs::superblock::Superblock, image_len: u64) -> Vec<Vec<u8>> {
    use iomapfs_fs::checkpoint::{encode_spill_table, spill_bytes, SpillTable};
    let bs = u64::from(sb.layout.block_size);
    let start = sb.layout.data.start;
    let table = |image_len: u64, extents: Vec<(u64, u64)>| {
        encode_spill_table(&SpillTable {
            image_len,
            image_crc: 0,
            extents,
        })
    };
    vec![
        table(
            image_len,
            vec![(start + 64 * bs, spill_bytes(sb, image_len))],
        ),
        table(5 * bs - 7, vec![(start + 9 * bs, 3 * bs), (start, 2 * bs)]),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use iomapfs_fs::codec::{decode_indexed_root_at, PageArea};

    /// The indexed seed of [`extent_pages`] gets past every check, so a
    /// fuzz run starts inside the indexed root's and the index page's
    /// round trips rather than at their magic.
    #[test]
    fn the_indexed_page_seed_decodes_in_both_parts() {
        let seeds = seeds("extent_pages");
        for seed in &seeds {
            extent_pages(seed);
        }
        let sb = read_superblock(base_volume()).expect("base superblock");
        let area = PageArea {
            start: sb.layout.data.start,
            len: sb.layout.data.len,
            block_size: u64::from(sb.layout.block_size),
        };
        let input = &seeds[2];
        let (len, rest) = input.split_first_chunk::<4>().unwrap();
        let (root, page) = rest.split_at(u32::from_le_bytes(*len) as usize);
        let decoded = decode_indexed_root_at(root, 0, "root", area).unwrap();
        assert!(!decoded.index.is_empty());
        assert!(index_page(sb.crc_seed(), page, area));
    }
}
