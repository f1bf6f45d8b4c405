//! Journal records: one [`Record`] per metadata change, tagged by kind.

use super::primitive::{check_mode, kind_code, Decoder, Encoder, Sink, U64_BYTES, U8_BYTES};
use crate::error::Result;
use crate::types::{FileKind, Record};

// Record tags. 0 is never used, so zeroed bytes never decode as a record.
const TAG_CREATE: u8 = 1;
const TAG_UNLINK: u8 = 2;
const TAG_RENAME: u8 = 3;
const TAG_FREE_INODE: u8 = 4;
const TAG_MAP_UNWRITTEN: u8 = 5;
const TAG_COMPLETE_WRITE: u8 = 6;
const TAG_SET_SIZE: u8 = 7;
const TAG_PUNCH: u8 = 8;
const TAG_LINK: u8 = 9;
const TAG_SET_ATTR: u8 = 10;
const TAG_SET_XATTR: u8 = 11;
const TAG_REMOVE_XATTR: u8 = 12;

// Rename flags.
const RENAME_EXCHANGE: u8 = 1;

/// Smallest encoded record (a tag and one u64: `FreeInode`).
pub const RECORD_MIN_ENCODED_LEN: usize = U8_BYTES + U64_BYTES;

/// Appends one record. Fails (writing nothing useful; discard the encoder)
/// if a name is invalid.
pub fn encode_record<S: Sink>(record: &Record, enc: &mut Encoder<S>) -> Result<()> {
    match record {
        Record::Create {
            ino,
            parent,
            name,
            kind,
            attrs,
            target,
        } => {
            enc.u8(TAG_CREATE);
            enc.u64(*ino);
            enc.u64(*parent);
            enc.name(name)?;
            enc.u8(kind_code(*kind));
            enc.attrs(attrs)?;
            if *kind == FileKind::Symlink {
                enc.symlink_target(target)?;
            } else if target.is_empty() {
                enc.byte_string(target)?;
            } else {
                return Err(crate::Error::invalid(
                    "encoding a create record",
                    "only symlinks have a target",
                ));
            }
        }
        Record::Unlink { parent, name, time } => {
            enc.u8(TAG_UNLINK);
            enc.u64(*parent);
            enc.name(name)?;
            enc.timestamp(*time);
        }
        Record::Rename {
            src_parent,
            src_name,
            dst_parent,
            dst_name,
            exchange,
            time,
        } => {
            enc.u8(TAG_RENAME);
            enc.u64(*src_parent);
            enc.name(src_name)?;
            enc.u64(*dst_parent);
            enc.name(dst_name)?;
            enc.u8(if *exchange { RENAME_EXCHANGE } else { 0 });
            enc.timestamp(*time);
        }
        Record::Link {
            ino,
            parent,
            name,
            time,
        } => {
            enc.u8(TAG_LINK);
            enc.u64(*ino);
            enc.u64(*parent);
            enc.name(name)?;
            enc.timestamp(*time);
        }
        Record::SetAttr {
            ino,
            mode,
            uid,
            gid,
            atime,
            mtime,
            ctime,
        } => {
            check_mode(*mode)
                .map_err(|r| crate::Error::invalid("encoding a set-attributes record", r))?;
            enc.u8(TAG_SET_ATTR);
            enc.u64(*ino);
            enc.u32(*mode);
            enc.u32(*uid);
            enc.u32(*gid);
            enc.timestamp(*atime);
            enc.timestamp(*mtime);
            enc.timestamp(*ctime);
        }
        Record::SetXattr {
            ino,
            name,
            value,
            ctime,
        } => {
            enc.u8(TAG_SET_XATTR);
            enc.u64(*ino);
            enc.xattr_name(name)?;
            enc.xattr_value(value)?;
            enc.timestamp(*ctime);
        }
        Record::RemoveXattr { ino, name, ctime } => {
            enc.u8(TAG_REMOVE_XATTR);
            enc.u64(*ino);
            enc.xattr_name(name)?;
            enc.timestamp(*ctime);
        }
        Record::FreeInode { ino } => {
            enc.u8(TAG_FREE_INODE);
            enc.u64(*ino);
        }
        Record::MapUnwritten {
            ino,
            file_off,
            len,
            addr,
        } => {
            enc.u8(TAG_MAP_UNWRITTEN);
            enc.u64(*ino);
            enc.u64(*file_off);
            enc.u64(*len);
            enc.u64(*addr);
        }
        Record::CompleteWrite {
            ino,
            file_off,
            len,
            min_size,
            mtime_ns,
        } => {
            enc.u8(TAG_COMPLETE_WRITE);
            enc.u64(*ino);
            enc.u64(*file_off);
            enc.u64(*len);
            enc.u64(*min_size);
            enc.u64(*mtime_ns);
        }
        Record::SetSize {
            ino,
            size,
            mtime_ns,
        } => {
            enc.u8(TAG_SET_SIZE);
            enc.u64(*ino);
            enc.u64(*size);
            enc.u64(*mtime_ns);
        }
        Record::Punch {
            ino,
            file_off,
            len,
            mtime_ns,
        } => {
            enc.u8(TAG_PUNCH);
            enc.u64(*ino);
            enc.u64(*file_off);
            enc.u64(*len);
            enc.u64(*mtime_ns);
        }
    }
    Ok(())
}

/// Bytes [`encode_record`] appends for `record`, measured by running it: the
/// length cannot disagree with the layout. A record it refuses (an invalid
/// name, which the state never lets into the journal) has no encoding; for
/// one, this is the bytes before the refusal, and the encode that follows
/// fails.
pub fn record_encoded_len(record: &Record) -> usize {
    let mut measure = Encoder::measure();
    let _refused = encode_record(record, &mut measure);
    measure.len()
}

/// Reads one record.
pub fn decode_record(dec: &mut Decoder<'_>) -> Result<Record> {
    let at = dec.position();
    let tag = dec.u8()?;
    let record = match tag {
        TAG_CREATE => {
            let ino = dec.u64()?;
            let parent = dec.u64()?;
            let name = dec.name()?;
            let kind = dec.kind()?;
            let attrs = dec.attrs()?;
            let target = if kind == FileKind::Symlink {
                dec.symlink_target()?
            } else {
                dec.byte_string(0, "target of a non-symlink")?
            };
            Record::Create {
                ino,
                parent,
                name,
                kind,
                attrs,
                target,
            }
        }
        TAG_UNLINK => Record::Unlink {
            parent: dec.u64()?,
            name: dec.name()?,
            time: dec.timestamp()?,
        },
        TAG_RENAME => {
            let src_parent = dec.u64()?;
            let src_name = dec.name()?;
            let dst_parent = dec.u64()?;
            let dst_name = dec.name()?;
            let flags_at = dec.position();
            let exchange = match dec.u8()? {
                0 => false,
                RENAME_EXCHANGE => true,
                other => {
                    return Err(dec.error_at(flags_at, format!("unknown rename flags {other}")))
                }
            };
            Record::Rename {
                src_parent,
                src_name,
                dst_parent,
                dst_name,
                exchange,
                time: dec.timestamp()?,
            }
        }
        TAG_LINK => Record::Link {
            ino: dec.u64()?,
            parent: dec.u64()?,
            name: dec.name()?,
            time: dec.timestamp()?,
        },
        TAG_SET_ATTR => {
            let ino = dec.u64()?;
            let mode_at = dec.position();
            let mode = dec.u32()?;
            check_mode(mode).map_err(|r| dec.error_at(mode_at, r))?;
            Record::SetAttr {
                ino,
                mode,
                uid: dec.u32()?,
                gid: dec.u32()?,
                atime: dec.timestamp()?,
                mtime: dec.timestamp()?,
                ctime: dec.timestamp()?,
            }
        }
        TAG_SET_XATTR => Record::SetXattr {
            ino: dec.u64()?,
            name: dec.xattr_name()?,
            value: dec.xattr_value()?,
            ctime: dec.timestamp()?,
        },
        TAG_REMOVE_XATTR => Record::RemoveXattr {
            ino: dec.u64()?,
            name: dec.xattr_name()?,
            ctime: dec.timestamp()?,
        },
        TAG_FREE_INODE => Record::FreeInode { ino: dec.u64()? },
        TAG_MAP_UNWRITTEN => Record::MapUnwritten {
            ino: dec.u64()?,
            file_off: dec.u64()?,
            len: dec.u64()?,
            addr: dec.u64()?,
        },
        TAG_COMPLETE_WRITE => Record::CompleteWrite {
            ino: dec.u64()?,
            file_off: dec.u64()?,
            len: dec.u64()?,
            min_size: dec.u64()?,
            mtime_ns: dec.u64()?,
        },
        TAG_SET_SIZE => Record::SetSize {
            ino: dec.u64()?,
            size: dec.u64()?,
            mtime_ns: dec.u64()?,
        },
        TAG_PUNCH => Record::Punch {
            ino: dec.u64()?,
            file_off: dec.u64()?,
            len: dec.u64()?,
            mtime_ns: dec.u64()?,
        },
        other => return Err(dec.error_at(at, format!("unknown record tag {other}"))),
    };
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::limits::MAX_NAME_LEN;
    use crate::types::{InodeAttrs, Timestamp};
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    fn all_records() -> Vec<Record> {
        vec![
            Record::Create {
                ino: 7,
                parent: 1,
                name: "hello.txt".into(),
                kind: FileKind::Regular,
                attrs: InodeAttrs::new(0o644, 1000, 100, Timestamp::from_ns(123)),
                target: vec![],
            },
            Record::Create {
                ino: 8,
                parent: 7,
                name: "d".repeat(MAX_NAME_LEN),
                kind: FileKind::Directory,
                attrs: InodeAttrs::new(
                    0o7777,
                    u32::MAX,
                    0,
                    Timestamp {
                        sec: -5,
                        nsec: 999_999_999,
                    },
                ),
                target: vec![],
            },
            Record::Create {
                ino: 9,
                parent: 1,
                name: "link".into(),
                kind: FileKind::Symlink,
                attrs: InodeAttrs::new(0o777, 0, 0, Timestamp::from_ns(1)),
                target: b"../some/where".to_vec(),
            },
            Record::Unlink {
                parent: 1,
                name: "ünïcødé".into(),
                time: Timestamp::from_ns(77),
            },
            Record::Rename {
                src_parent: 1,
                src_name: "a".into(),
                dst_parent: 2,
                dst_name: "b".into(),
                exchange: false,
                time: Timestamp::from_ns(78),
            },
            Record::Rename {
                src_parent: 1,
                src_name: "a".into(),
                dst_parent: 2,
                dst_name: "b".into(),
                exchange: true,
                time: Timestamp {
                    sec: i64::MIN,
                    nsec: 0,
                },
            },
            Record::Link {
                ino: 9,
                parent: 3,
                name: "again".into(),
                time: Timestamp::from_ns(79),
            },
            Record::SetAttr {
                ino: 9,
                mode: 0o4755,
                uid: 5,
                gid: 6,
                atime: Timestamp {
                    sec: i64::MAX,
                    nsec: 1,
                },
                mtime: Timestamp::from_ns(2),
                ctime: Timestamp::from_ns(3),
            },
            Record::SetXattr {
                ino: 9,
                name: "user.mime".into(),
                value: vec![0, 1, 2, 255],
                ctime: Timestamp::from_ns(4),
            },
            Record::SetXattr {
                ino: 9,
                name: "user.empty".into(),
                value: vec![],
                ctime: Timestamp::from_ns(4),
            },
            Record::RemoveXattr {
                ino: 9,
                name: "user.mime".into(),
                ctime: Timestamp::from_ns(5),
            },
            Record::FreeInode { ino: 9 },
            Record::MapUnwritten {
                ino: 9,
                file_off: 4096,
                len: 8192,
                addr: 1 << 40,
            },
            Record::CompleteWrite {
                ino: 9,
                file_off: 0,
                len: 4096,
                min_size: 100,
                mtime_ns: 5,
            },
            Record::SetSize {
                ino: 9,
                size: 0,
                mtime_ns: 6,
            },
            Record::Punch {
                ino: 9,
                file_off: 4096,
                len: 4096,
                mtime_ns: 7,
            },
        ]
    }

    /// Which kind a record is; no wildcard arm, so a new kind does not
    /// compile until it is listed here (and then in `all_records`).
    fn kind_index(record: &Record) -> usize {
        match record {
            Record::Create { .. } => 0,
            Record::Unlink { .. } => 1,
            Record::Rename { .. } => 2,
            Record::FreeInode { .. } => 3,
            Record::MapUnwritten { .. } => 4,
            Record::CompleteWrite { .. } => 5,
            Record::SetSize { .. } => 6,
            Record::Punch { .. } => 7,
            Record::Link { .. } => 8,
            Record::SetAttr { .. } => 9,
            Record::SetXattr { .. } => 10,
            Record::RemoveXattr { .. } => 11,
        }
    }
    const RECORD_KINDS: usize = 12;

    #[test]
    fn the_sample_records_cover_every_kind() {
        let mut seen = [false; RECORD_KINDS];
        for r in all_records() {
            seen[kind_index(&r)] = true;
        }
        assert!(seen.iter().all(|&s| s), "kinds without a sample: {seen:?}");
    }

    #[test]
    fn records_round_trip() {
        for r in all_records() {
            let mut enc = Encoder::new();
            encode_record(&r, &mut enc).unwrap();
            assert_eq!(enc.len(), record_encoded_len(&r), "{r:?}");
            let bytes = enc.into_bytes();
            let mut dec = Decoder::new(&bytes, 0, "test");
            assert_eq!(decode_record(&mut dec).unwrap(), r);
            dec.finish().unwrap();
        }
    }

    #[test]
    fn record_truncations_and_flips_never_panic() {
        let mut rng = SmallRng::seed_from_u64(1);
        for r in all_records() {
            let mut enc = Encoder::new();
            encode_record(&r, &mut enc).unwrap();
            let bytes = enc.into_bytes();
            for cut in 0..bytes.len() {
                let mut dec = Decoder::new(&bytes[..cut], 100, "test");
                assert!(decode_record(&mut dec).is_err(), "cut {cut} of {r:?}");
            }
            for _ in 0..2000 {
                let mut b = bytes.clone();
                let i = rng.gen_range(0..b.len());
                b[i] ^= 1 << rng.gen_range(0..8);
                let mut dec = Decoder::new(&b, 0, "test");
                let _ = decode_record(&mut dec);
            }
        }
    }

    #[test]
    fn invalid_names_are_refused_both_ways() {
        for bad in ["", ".", "..", "a/b", "a\0b"] {
            let r = Record::Unlink {
                parent: 1,
                name: bad.to_string(),
                time: Timestamp::default(),
            };
            let mut enc = Encoder::new();
            assert!(encode_record(&r, &mut enc).is_err(), "{bad:?}");
            // Hand-encode it anyway: the decoder refuses it.
            let mut enc = Encoder::new();
            enc.u8(TAG_UNLINK);
            enc.u64(1);
            enc.string(bad).unwrap();
            let bytes = enc.into_bytes();
            let err = decode_record(&mut Decoder::new(&bytes, 1000, "test")).unwrap_err();
            match err {
                Error::Corrupt { offset, .. } => assert_eq!(offset, 1009),
                other => panic!("{other}"),
            }
        }
        let long = "x".repeat(MAX_NAME_LEN + 1);
        assert!(Encoder::new().name(&long).is_err());
        let mut enc = Encoder::new();
        enc.string(&long).unwrap();
        assert!(Decoder::new(enc.as_bytes(), 0, "t").name().is_err());
        // Bad UTF-8.
        let bytes = [2u8, 0, 0xff, 0xfe];
        assert!(Decoder::new(&bytes, 0, "t").string().is_err());
    }

    #[test]
    fn bad_tags_and_enums_are_rejected() {
        for tag in [0u8, 13, 255] {
            let bytes = [tag; 64];
            let err = decode_record(&mut Decoder::new(&bytes, 5, "test")).unwrap_err();
            assert!(err.to_string().contains("unknown record tag"), "{err}");
            assert!(err.to_string().contains("byte 5"), "{err}");
        }
        let mut enc = Encoder::new();
        encode_record(
            &Record::Create {
                ino: 2,
                parent: 1,
                name: "x".into(),
                kind: FileKind::Regular,
                attrs: InodeAttrs::default(),
                target: vec![],
            },
            &mut enc,
        )
        .unwrap();
        let mut bytes = enc.into_bytes();
        let kind_at = 1 + 8 + 8 + 2 + 1;
        bytes[kind_at] = 3; // a symlink without a target
        let err = decode_record(&mut Decoder::new(&bytes, 0, "test")).unwrap_err();
        assert!(err.to_string().contains("symlink target"), "{err}");
        bytes[kind_at] = 8;
        let err = decode_record(&mut Decoder::new(&bytes, 0, "test")).unwrap_err();
        assert!(err.to_string().contains("unknown file kind 8"), "{err}");
    }

    /// A record's size as the table in `docs/FORMAT.md` gives it.
    fn documented_len(record: &Record) -> usize {
        match record {
            Record::Create { name, target, .. } => 96 + name.len() + target.len(),
            Record::Unlink { name, .. } => 23 + name.len(),
            Record::Rename {
                src_name, dst_name, ..
            } => 34 + src_name.len() + dst_name.len(),
            Record::Link { name, .. } => 31 + name.len(),
            Record::SetAttr { .. } => 57,
            Record::SetXattr { name, value, .. } => 27 + name.len() + value.len(),
            Record::RemoveXattr { name, .. } => 23 + name.len(),
            Record::FreeInode { .. } => 9,
            Record::MapUnwritten { .. } => 33,
            Record::CompleteWrite { .. } => 41,
            Record::SetSize { .. } => 25,
            Record::Punch { .. } => 33,
        }
    }

    /// Pins the encoded lengths against the bytes written, kind by kind (what
    /// the journal reserves is what it writes), and against the format's
    /// documentation.
    #[test]
    fn encoded_len_is_the_written_length_for_every_kind() {
        let mut by_kind = [None; RECORD_KINDS];
        for r in all_records() {
            let mut enc = Encoder::new();
            encode_record(&r, &mut enc).unwrap();
            assert_eq!(record_encoded_len(&r), enc.len(), "{r:?}");
            assert_eq!(enc.len(), documented_len(&r), "{r:?} vs docs/FORMAT.md");
            assert!(enc.len() >= RECORD_MIN_ENCODED_LEN, "{r:?}");
            by_kind[kind_index(&r)].get_or_insert(enc.len());
        }
        // The smallest record is the one the constant names.
        assert_eq!(
            by_kind[kind_index(&Record::FreeInode { ino: 1 })],
            Some(RECORD_MIN_ENCODED_LEN)
        );
    }
}
