//! The on-disk entry format and its checks.
//!
//! Layout (all integers little-endian):
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `TSPLAN\0\x01` |
//! | 8 | 4 | plan format version ([`PLAN_FORMAT_VERSION`]) |
//! | 12 | 32 | contract key |
//! | 44 | 8 | payload length in bytes |
//! | 52 | 32 | BLAKE3 digest of the payload |
//! | 84 | 8 | payload: number `n` of partial-mask words |
//! | 92 | 8n | payload: the plan's `partials.data` words, raw |
//! | 92 + 8n | rest | payload: postcard encoding of the [`Plan`] with `partials.data` empty |
//!
//! The plan is postcard-encoded except its bulk bitmask words: postcard writes each `u64` as a
//! varint (up to 10 bytes, ~50 ms to decode 32 MB of random bits), so they are stored raw and read
//! straight into the plan's vector. That makes a warm load of a dense 16K plan ~3x faster than
//! building it, where pure postcard was ~2x slower than building.
//!
//! Contract: [`decode`] accepts exactly the bytes [`encode`] produced for the requested key and
//! rejects anything else with a [`RejectReason`] naming the first check that failed. The checksum
//! guards against corruption, not against a forged entry (BLAKE3 is not keyed), so a decoded plan
//! is also checked for what a forger could break: its contract key must be the one recomputed
//! from its own mask, shape and tile, and it must pass [`Plan::check_consistent`], so that no
//! entry, whatever its bytes, can make a consumer index out of range. Allocations are bounded by
//! the payload length, which the caller has checked against the file's size.

use std::borrow::Cow;
use std::fmt;
use std::io::Read;
use tessera_plan::{
    contract_key_of_canonical, ContractKey, PartialMasks, Plan, PLAN_FORMAT_VERSION,
};

/// First bytes of every entry.
pub const MAGIC: [u8; 8] = *b"TSPLAN\x00\x01";
/// Header size in bytes.
pub const HEADER_LEN: usize = 84;

/// Why an entry was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RejectReason {
    /// The entry exists but could not be read (permissions, I/O error).
    Unreadable(String),
    /// Something other than a regular file sits at the entry's path.
    NotAFile,
    /// Zero-length file.
    Empty,
    /// Shorter than the header.
    TruncatedHeader {
        /// Bytes present.
        len: u64,
    },
    /// The file does not start with the entry magic.
    BadMagic,
    /// The header's format version is not this build's.
    Version {
        /// The header's version.
        found: u32,
        /// This build's version.
        expected: u32,
    },
    /// The header names another contract (for example an entry copied over another).
    KeyMismatch {
        /// The key in the header.
        found: ContractKey,
    },
    /// The payload length in the header is not the number of bytes that follow it.
    Length {
        /// Length the header states.
        header: u64,
        /// Bytes actually following the header.
        actual: u64,
    },
    /// The payload's BLAKE3 digest differs from the header's.
    Checksum,
    /// The payload is not a valid postcard-encoded plan.
    Decode(String),
    /// The decoded plan belongs to another contract.
    ContractMismatch {
        /// The decoded plan's contract.
        found: ContractKey,
    },
    /// The decoded plan's fields do not hash to its contract key, or it is internally
    /// inconsistent (a forged or hand-edited entry).
    Inconsistent(String),
    /// The decoded plan carries another format version.
    PlanVersion {
        /// The decoded plan's format version.
        found: u32,
        /// This build's format version.
        expected: u32,
    },
    /// The file name is not `<64 hex digits>.tplan` (only reported by `verify`).
    BadName,
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let short = |k: &ContractKey| k.hex()[..16].to_string();
        match self {
            RejectReason::Unreadable(e) => write!(f, "unreadable: {e}"),
            RejectReason::NotAFile => f.write_str("not a regular file"),
            RejectReason::Empty => f.write_str("empty file"),
            RejectReason::TruncatedHeader { len } => {
                write!(f, "truncated header: {len} of {HEADER_LEN} bytes")
            }
            RejectReason::BadMagic => f.write_str("bad magic bytes"),
            RejectReason::Version { found, expected } => {
                write!(f, "format version {found}, expected {expected}")
            }
            RejectReason::KeyMismatch { found } => {
                write!(
                    f,
                    "header holds key {}…, not the requested key",
                    short(found)
                )
            }
            RejectReason::Length { header, actual } => write!(
                f,
                "payload length {header} in header, {actual} bytes present"
            ),
            RejectReason::Checksum => f.write_str("payload checksum mismatch"),
            RejectReason::Decode(e) => write!(f, "payload does not decode: {e}"),
            RejectReason::ContractMismatch { found } => write!(
                f,
                "plan holds contract {}…, not the requested key",
                short(found)
            ),
            RejectReason::Inconsistent(e) => write!(f, "inconsistent plan: {e}"),
            RejectReason::PlanVersion { found, expected } => {
                write!(f, "plan format version {found}, expected {expected}")
            }
            RejectReason::BadName => f.write_str("file name is not <contract key>.tplan"),
        }
    }
}

/// The header fields of an entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Plan format version of the payload.
    pub version: u32,
    /// The full contract key.
    pub key: ContractKey,
    /// Bytes of payload after the header.
    pub payload_len: u64,
    /// BLAKE3 digest of the payload.
    pub checksum: [u8; 32],
}

impl Header {
    /// The header as its 84 bytes on disk.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..8].copy_from_slice(&MAGIC);
        h[8..12].copy_from_slice(&self.version.to_le_bytes());
        h[12..44].copy_from_slice(&self.key.0);
        h[44..52].copy_from_slice(&self.payload_len.to_le_bytes());
        h[52..84].copy_from_slice(&self.checksum);
        h
    }

    /// Parses a header and checks magic, version and key against `expected`.
    pub fn parse(bytes: &[u8], expected: &ContractKey) -> Result<Header, RejectReason> {
        if bytes.is_empty() {
            return Err(RejectReason::Empty);
        }
        if bytes.len() < HEADER_LEN {
            return Err(RejectReason::TruncatedHeader {
                len: bytes.len() as u64,
            });
        }
        if bytes[0..8] != MAGIC {
            return Err(RejectReason::BadMagic);
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if version != PLAN_FORMAT_VERSION {
            return Err(RejectReason::Version {
                found: version,
                expected: PLAN_FORMAT_VERSION,
            });
        }
        let key = ContractKey(bytes[12..44].try_into().expect("32 bytes"));
        if key != *expected {
            return Err(RejectReason::KeyMismatch { found: key });
        }
        Ok(Header {
            version,
            key,
            payload_len: u64::from_le_bytes(bytes[44..52].try_into().expect("8 bytes")),
            checksum: bytes[52..84].try_into().expect("32 bytes"),
        })
    }
}

/// An encoded entry in pieces, so that the bulk words are written without another copy.
pub struct Encoded<'a> {
    /// The header bytes.
    pub header: [u8; HEADER_LEN],
    /// Number of partial-mask words, little-endian.
    pub count: [u8; 8],
    /// The partial-mask words as little-endian bytes (borrowed from the plan on little-endian
    /// machines).
    pub words: Cow<'a, [u8]>,
    /// postcard encoding of the plan with `partials.data` left empty.
    pub tail: Vec<u8>,
}

impl Encoded<'_> {
    /// The pieces in file order.
    pub fn parts(&self) -> [&[u8]; 4] {
        [&self.header, &self.count, &self.words, &self.tail]
    }

    /// Total entry size in bytes.
    pub fn len(&self) -> u64 {
        (HEADER_LEN + 8 + self.words.len() + self.tail.len()) as u64
    }

    /// Always false: an entry has at least its header.
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// Encodes `plan` as an entry, in pieces.
pub fn encode_parts(plan: &Plan) -> Result<Encoded<'_>, postcard::Error> {
    // An exhaustive literal: a new `Plan` field is a compile error here, not a silent omission.
    let skeleton = Plan {
        format_version: plan.format_version,
        contract: plan.contract,
        mask: plan.mask.clone(),
        shape: plan.shape,
        tile: plan.tile,
        q_tiles: plan.q_tiles,
        kv_tiles: plan.kv_tiles,
        batch_groups: plan.batch_groups,
        head_groups: plan.head_groups,
        group_plan: plan.group_plan.clone(),
        head_plans: plan.head_plans.clone(),
        partials: PartialMasks {
            tile: plan.partials.tile,
            words_per_row: plan.partials.words_per_row,
            data: Vec::new(),
        },
        stats: plan.stats.clone(),
    };
    let tail = postcard::to_stdvec(&skeleton)?;
    let count = (plan.partials.data.len() as u64).to_le_bytes();
    let words = words_as_le_bytes(&plan.partials.data);
    let mut h = blake3::Hasher::new();
    h.update(&count);
    h.update(&words);
    h.update(&tail);
    let header = Header {
        version: PLAN_FORMAT_VERSION,
        key: plan.contract,
        payload_len: (8 + words.len() + tail.len()) as u64,
        checksum: *h.finalize().as_bytes(),
    };
    Ok(Encoded {
        header: header.to_bytes(),
        count,
        words,
        tail,
    })
}

/// Encodes `plan` as one complete entry (header + payload).
pub fn encode(plan: &Plan) -> Result<Vec<u8>, postcard::Error> {
    let e = encode_parts(plan)?;
    let mut out = Vec::with_capacity(e.len() as usize);
    for p in e.parts() {
        out.extend_from_slice(p);
    }
    Ok(out)
}

/// Reads and checks the payload that follows `header` (the caller has checked that exactly
/// `header.payload_len` bytes follow), adding the bytes read to `read`.
pub fn read_payload(
    r: &mut impl Read,
    header: &Header,
    expected: &ContractKey,
    read: &mut u64,
) -> Result<Plan, RejectReason> {
    let io_err = |e: std::io::Error, got: u64| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            RejectReason::Length {
                header: header.payload_len,
                actual: got,
            }
        } else {
            RejectReason::Unreadable(e.to_string())
        }
    };
    if header.payload_len < 8 {
        return Err(RejectReason::Decode(
            "payload shorter than its word count".into(),
        ));
    }
    let mut count = [0u8; 8];
    r.read_exact(&mut count).map_err(|e| io_err(e, 0))?;
    *read += 8;
    let n = u64::from_le_bytes(count);
    let room = (header.payload_len - 8) / 8;
    if n > room {
        return Err(RejectReason::Decode(format!(
            "{n} partial-mask words do not fit in the payload"
        )));
    }
    let mut words = vec![0u64; n as usize];
    r.read_exact(words_as_bytes_mut(&mut words))
        .map_err(|e| io_err(e, 8))?;
    *read += n * 8;
    let mut tail = vec![0u8; (header.payload_len - 8 - n * 8) as usize];
    r.read_exact(&mut tail).map_err(|e| io_err(e, 8 + n * 8))?;
    *read += tail.len() as u64;
    let mut h = blake3::Hasher::new();
    h.update(&count);
    h.update(words_as_bytes_mut(&mut words));
    h.update(&tail);
    if *h.finalize().as_bytes() != header.checksum {
        return Err(RejectReason::Checksum);
    }
    if cfg!(target_endian = "big") {
        for w in &mut words {
            *w = u64::from_le(*w);
        }
    }
    finish(words, &tail, expected)
}

/// Decodes the postcard tail, puts the words back, and checks the plan's identity.
fn finish(words: Vec<u64>, tail: &[u8], expected: &ContractKey) -> Result<Plan, RejectReason> {
    let (mut plan, rest): (Plan, &[u8]) =
        postcard::take_from_bytes(tail).map_err(|e| RejectReason::Decode(e.to_string()))?;
    if !rest.is_empty() {
        return Err(RejectReason::Decode(format!(
            "{} bytes after the plan",
            rest.len()
        )));
    }
    if !plan.partials.data.is_empty() {
        return Err(RejectReason::Decode(
            "partial-mask words inside the postcard part".into(),
        ));
    }
    plan.partials.data = words;
    if plan.contract != *expected {
        return Err(RejectReason::ContractMismatch {
            found: plan.contract,
        });
    }
    if plan.format_version != PLAN_FORMAT_VERSION {
        return Err(RejectReason::PlanVersion {
            found: plan.format_version,
            expected: PLAN_FORMAT_VERSION,
        });
    }
    if contract_key_of_canonical(&plan.mask, plan.shape, plan.tile) != plan.contract {
        return Err(RejectReason::Inconsistent(
            "its mask, shape and tile do not hash to its contract key".into(),
        ));
    }
    plan.check_consistent()
        .map_err(|e| RejectReason::Inconsistent(e.to_string()))?;
    Ok(plan)
}

/// Checks a complete entry (header + payload) for `expected` and decodes it.
pub fn decode(bytes: &[u8], expected: &ContractKey) -> Result<Plan, RejectReason> {
    let header = Header::parse(bytes, expected)?;
    let actual = (bytes.len() - HEADER_LEN) as u64;
    if actual != header.payload_len {
        return Err(RejectReason::Length {
            header: header.payload_len,
            actual,
        });
    }
    let mut read = 0;
    read_payload(&mut &bytes[HEADER_LEN..], &header, expected, &mut read)
}

/// The words as little-endian bytes: a view on little-endian machines, a copy otherwise.
fn words_as_le_bytes(words: &[u64]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        // SAFETY: u8 has alignment 1 and the slice covers exactly the words' bytes.
        Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), std::mem::size_of_val(words))
        })
    } else {
        Cow::Owned(words.iter().flat_map(|w| w.to_le_bytes()).collect())
    }
}

/// The words' memory as bytes (native order), for reading into them directly.
fn words_as_bytes_mut(words: &mut [u64]) -> &mut [u8] {
    let len = std::mem::size_of_val(words);
    // SAFETY: u8 has alignment 1, every byte pattern is a valid u64, and the slice covers
    // exactly the words' bytes while borrowing them mutably.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), len) }
}

/// Parses the key out of an entry file name `<64 hex digits>.tplan`.
pub fn key_from_file_name(name: &str) -> Option<ContractKey> {
    let hex = name.strip_suffix(".tplan")?;
    if hex.len() != 64 {
        return None;
    }
    let mut key = [0u8; 32];
    for (i, b) in key.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    // Only the canonical lowercase spelling names an entry.
    (ContractKey(key).hex() == hex).then_some(ContractKey(key))
}

/// File name of the entry of `key`.
pub fn file_name(key: &ContractKey) -> String {
    format!("{}.tplan", key.hex())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_mask::Mask;
    use tessera_plan::{build_plan, PlanShape, TileShape};

    fn plan(len: usize) -> Plan {
        build_plan(
            &Mask::causal(),
            PlanShape::new(1, 1, len, len).unwrap(),
            TileShape::new(64, 128).unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn roundtrip_is_exact() {
        for len in [100, 1000, 4096] {
            let p = plan(len);
            assert!(!p.partials.data.is_empty());
            let bytes = encode(&p).unwrap();
            assert_eq!(bytes.len() as u64, encode_parts(&p).unwrap().len());
            assert_eq!(&bytes[..8], &MAGIC);
            assert_eq!(decode(&bytes, &p.contract).unwrap(), p);
        }
    }

    #[test]
    fn every_single_byte_flip_is_rejected() {
        let p = plan(300);
        let bytes = encode(&p).unwrap();
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x01;
            assert!(
                decode(&b, &p.contract).is_err(),
                "flip at byte {i} accepted"
            );
        }
        for n in 0..bytes.len() {
            assert!(
                decode(&bytes[..n], &p.contract).is_err(),
                "prefix {n} accepted"
            );
        }
    }

    #[test]
    fn file_names() {
        let p = plan(128);
        let name = file_name(&p.contract);
        assert_eq!(key_from_file_name(&name), Some(p.contract));
        assert_eq!(key_from_file_name(&name.to_uppercase()), None);
        assert_eq!(key_from_file_name("abc.tplan"), None);
        assert_eq!(key_from_file_name(&name.replace(".tplan", ".bin")), None);
    }
}
