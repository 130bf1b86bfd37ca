//! Sealing pages before they leave the process (to a remote node or to disk).
//!
//! # Construction (reasoning in docs/SECURITY.md)
//!
//! A *master key* comes from a key file (32 raw bytes or 64 hex digits,
//! owner-only) or is drawn per run from the kernel's random source. Every
//! [`Sealer`] — one per device, per daemon run — draws a fresh 256-bit random
//! salt and derives its own 256-bit *subkey* with HKDF-SHA256
//! (`salt`, `master`, info `"tmem seal v2 " + algorithm`). The AEAD nonce is
//! the page's *version* (64 bits, never reused by one store) followed by the
//! sealer's 32-bit key id (also HKDF-derived). So a (subkey, nonce) pair can
//! only repeat if two sealers drew the same 256-bit salt: devices of one
//! daemon, restarts with the same key file and stores that restart their
//! version counters all seal under different subkeys. A successor that takes
//! over a store (hand-over) is given the salt with the version counter, and
//! so continues the same sequence instead of restarting it.
//!
//! The cipher is AES-256-GCM where the CPU has AES and carry-less multiply
//! instructions (x86-64 AES-NI + PCLMULQDQ, AArch64 AES + PMULL), and
//! ChaCha20-Poly1305 elsewhere; both from `ring` (BoringSSL's assembly).
//! The associated data binds the key id, the pool, object and index, and
//! the version, so a value copied to another key, an older value replayed
//! under the same key, or a value sealed by another sealer fails to open,
//! exactly like a tampered one.

use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use ring::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};
use ring::hkdf;
use ring::rand::{SecureRandom, SystemRandom};

use crate::TierKey;

/// Bytes a sealed value adds to the plaintext (the AEAD tag).
pub const SEAL_OVERHEAD: usize = 16;
/// Bytes of the per-sealer random salt.
pub const SALT_LEN: usize = 32;
/// Bytes of [`Sealer::hand_over`]'s state: algorithm, salt, master key.
pub const SEALER_STATE: usize = 1 + SALT_LEN + 32;

/// Sealing errors.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    /// The key file is unusable.
    #[error("key file {path}: {reason}")]
    KeyFile {
        /// Path.
        path: String,
        /// Why.
        reason: String,
    },
    /// No randomness for a key or salt.
    #[error("the kernel's random source failed")]
    Random,
    /// The value is not what was sealed under this key and version.
    #[error("authentication failed (tampered, moved to another key, or an older version)")]
    Auth,
    /// The value is too short to hold a tag.
    #[error("sealed value of {0} bytes is shorter than its tag")]
    Short(usize),
}

/// The AEAD a sealer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SealAlgorithm {
    /// AES-256-GCM (chosen where the CPU accelerates AES and GHASH).
    Aes256Gcm,
    /// ChaCha20-Poly1305 (chosen where it does not).
    ChaCha20Poly1305,
}

impl SealAlgorithm {
    /// The faster of the two on this CPU.
    pub fn preferred() -> Self {
        if aes_hardware() {
            Self::Aes256Gcm
        } else {
            Self::ChaCha20Poly1305
        }
    }

    /// Name as printed and bound into the key derivation.
    pub fn name(self) -> &'static str {
        match self {
            Self::Aes256Gcm => "AES-256-GCM",
            Self::ChaCha20Poly1305 => "ChaCha20-Poly1305",
        }
    }

    fn ring(self) -> &'static aead::Algorithm {
        match self {
            Self::Aes256Gcm => &aead::AES_256_GCM,
            Self::ChaCha20Poly1305 => &aead::CHACHA20_POLY1305,
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn aes_hardware() -> bool {
    std::arch::is_x86_feature_detected!("aes") && std::arch::is_x86_feature_detected!("pclmulqdq")
}

#[cfg(target_arch = "aarch64")]
fn aes_hardware() -> bool {
    std::arch::is_aarch64_feature_detected!("aes") && std::arch::is_aarch64_feature_detected!("pmull")
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn aes_hardware() -> bool {
    false
}

/// A 256-bit master key: from a key file, or random for this run.
#[derive(Clone)]
pub struct MasterKey([u8; 32]);

impl std::fmt::Debug for MasterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MasterKey(..)")
    }
}

impl MasterKey {
    /// A key given as bytes (tests, benches).
    pub fn from_bytes(key: [u8; 32]) -> Self {
        Self(key)
    }

    /// A fresh random key (per daemon run).
    pub fn random() -> Result<Self, SealError> {
        let mut k = [0u8; 32];
        SystemRandom::new().fill(&mut k).map_err(|_| SealError::Random)?;
        Ok(Self(k))
    }

    /// Loads a key from a regular file that only its owner can read (mode
    /// 0600 or 0400, owned by the daemon's user) holding 32 raw bytes or 64
    /// hex digits (and an optional newline). The file is opened with
    /// `O_NOFOLLOW | O_NONBLOCK`, so a symlink or a FIFO is refused at once,
    /// and its size is checked before a byte is read.
    pub fn from_file(path: &Path) -> Result<Self, SealError> {
        let err = |reason: String| SealError::KeyFile { path: path.display().to_string(), reason };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP) => err("is a symbolic link; give the real file".into()),
                _ => err(e.to_string()),
            })?;
        let meta = file.metadata().map_err(|e| err(e.to_string()))?;
        if !meta.file_type().is_file() {
            return Err(err("not a regular file".into()));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(err(format!("mode {:o} lets others read it; chmod 600", meta.mode() & 0o777)));
        }
        if meta.uid() != rustix::process::geteuid().as_raw() {
            return Err(err("not owned by the daemon's user".into()));
        }
        if !matches!(meta.len(), 32 | 64 | 65) {
            return Err(err(format!(
                "{} bytes; expected 32 raw bytes or 64 hex digits (65 with a newline)",
                meta.len()
            )));
        }
        let mut raw = Vec::with_capacity(65);
        file.take(65).read_to_end(&mut raw).map_err(|e| err(e.to_string()))?;
        parse_key(&raw).map(Self).ok_or_else(|| err("expected 32 raw bytes or 64 hex digits".into()))
    }
}

/// Seals and opens values under one subkey derived from a master key and a
/// salt of its own.
pub struct Sealer {
    key: LessSafeKey,
    /// Kept for [`Sealer::hand_over`] only.
    master: MasterKey,
    algorithm: SealAlgorithm,
    key_id: u32,
    salt: [u8; SALT_LEN],
    /// The versions sealed under this subkey (shared with every sealer of
    /// the same subkey in the process, a resumed one included).
    #[cfg(any(test, feature = "nonce-audit"))]
    audit: std::sync::Arc<audit::Versions>,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer")
            .field("algorithm", &self.algorithm)
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

/// HKDF output length request for `expand`.
struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

fn derive<const N: usize>(prk: &hkdf::Prk, info: &[&[u8]]) -> [u8; N] {
    let mut out = [0u8; N];
    prk.expand(info, Len(N))
        .and_then(|okm| okm.fill(&mut out))
        .expect("HKDF-SHA256 gives up to 8160 bytes; we ask for at most 32");
    out
}

impl Sealer {
    /// A sealer with a fresh random salt: its subkey is its own, whatever
    /// other sealers use the same master key.
    pub fn new(master: &MasterKey) -> Result<Self, SealError> {
        Self::with_algorithm(master, SealAlgorithm::preferred())
    }

    /// [`Sealer::new`] with a chosen algorithm (benches compare them).
    pub fn with_algorithm(master: &MasterKey, algorithm: SealAlgorithm) -> Result<Self, SealError> {
        let mut salt = [0u8; SALT_LEN];
        SystemRandom::new().fill(&mut salt).map_err(|_| SealError::Random)?;
        Ok(Self::resume(master, algorithm, salt))
    }

    /// The sealer that a predecessor with this master key, algorithm and
    /// salt had: for a hand-over that also continues the version counter.
    pub fn resume(master: &MasterKey, algorithm: SealAlgorithm, salt: [u8; SALT_LEN]) -> Self {
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, &salt).extract(&master.0);
        let name = algorithm.name().as_bytes();
        let subkey: [u8; 32] = derive(&prk, &[b"tmem seal v2 key ", name]);
        let id: [u8; 4] = derive(&prk, &[b"tmem seal v2 key id ", name]);
        let unbound = UnboundKey::new(algorithm.ring(), &subkey).expect("both algorithms take 256-bit keys");
        Self {
            key: LessSafeKey::new(unbound),
            master: master.clone(),
            algorithm,
            key_id: u32::from_le_bytes(id),
            salt,
            #[cfg(any(test, feature = "nonce-audit"))]
            audit: audit::versions_of(derive(&prk, &[b"tmem seal v2 audit ", name])),
        }
    }

    /// A sealer with a random master key (a run without a key file).
    pub fn random() -> Result<Self, SealError> {
        Self::new(&MasterKey::random()?)
    }

    /// The algorithm in use.
    pub fn algorithm(&self) -> SealAlgorithm {
        self.algorithm
    }

    /// The key id bound into every value.
    pub fn key_id(&self) -> u32 {
        self.key_id
    }

    /// The salt this sealer's subkey was derived with (handed to a successor).
    pub fn salt(&self) -> [u8; SALT_LEN] {
        self.salt
    }

    /// What a successor process needs to seal and open as this sealer
    /// does ([`Sealer::adopt`]): the algorithm, the salt and the master
    /// key. It travels only over the hand-over socket (owner only), which
    /// already carries the pages themselves.
    pub fn hand_over(&self) -> [u8; SEALER_STATE] {
        let mut b = [0u8; SEALER_STATE];
        b[0] = match self.algorithm {
            SealAlgorithm::Aes256Gcm => 1,
            SealAlgorithm::ChaCha20Poly1305 => 2,
        };
        b[1..1 + SALT_LEN].copy_from_slice(&self.salt);
        b[1 + SALT_LEN..].copy_from_slice(&self.master.0);
        b
    }

    /// The sealer that [`Sealer::hand_over`] described; `None` for an
    /// unknown algorithm.
    pub fn adopt(state: &[u8; SEALER_STATE]) -> Option<Self> {
        let algorithm = match state[0] {
            1 => SealAlgorithm::Aes256Gcm,
            2 => SealAlgorithm::ChaCha20Poly1305,
            _ => return None,
        };
        let salt = state[1..1 + SALT_LEN].try_into().expect("a salt's bytes");
        let master = MasterKey(state[1 + SALT_LEN..].try_into().expect("a key's bytes"));
        Some(Self::resume(&master, algorithm, salt))
    }

    fn nonce(&self, version: u64) -> Nonce {
        let mut n = [0u8; aead::NONCE_LEN];
        n[..8].copy_from_slice(&version.to_le_bytes());
        n[8..].copy_from_slice(&self.key_id.to_le_bytes());
        Nonce::assume_unique_for_key(n)
    }

    fn aad(&self, key: TierKey, version: u64) -> [u8; 32] {
        let mut a = [0u8; 32];
        a[..4].copy_from_slice(&self.key_id.to_le_bytes());
        a[4..8].copy_from_slice(&key.pool.to_le_bytes());
        a[8..16].copy_from_slice(&key.object.to_le_bytes());
        a[16..24].copy_from_slice(&key.index.to_le_bytes());
        a[24..].copy_from_slice(&version.to_le_bytes());
        a
    }

    /// Seals `plain` for (`key`, `version`) into `out` (cleared first).
    /// `version` must never repeat under one sealer (test builds check it).
    pub fn seal(&self, key: TierKey, version: u64, plain: &[u8], out: &mut Vec<u8>) {
        #[cfg(any(test, feature = "nonce-audit"))]
        self.audit.record(version, self.key_id);
        out.clear();
        out.extend_from_slice(plain);
        let tag = self
            .key
            .seal_in_place_separate_tag(self.nonce(version), Aad::from(self.aad(key, version)), out)
            .expect("both AEADs accept any page-sized message");
        out.extend_from_slice(tag.as_ref());
    }

    /// Opens a value sealed for (`key`, `version`) in place; on success
    /// `buf` holds the plaintext, on failure it is empty.
    pub fn open(&self, key: TierKey, version: u64, buf: &mut Vec<u8>) -> Result<(), SealError> {
        let n = buf.len().checked_sub(SEAL_OVERHEAD).ok_or(SealError::Short(buf.len()))?;
        let tag = aead::Tag::try_from(&buf[n..]).map_err(|_| SealError::Short(buf.len()))?;
        buf.truncate(n);
        match self.key.open_in_place_separate_tag(self.nonce(version), Aad::from(self.aad(key, version)), tag, buf, 0..)
        {
            Ok(_) => Ok(()),
            Err(_) => {
                buf.clear();
                Err(SealError::Auth)
            }
        }
    }
}

/// Test builds (and builds with the `nonce-audit` feature) record every
/// (subkey, nonce) pair sealed in this process and panic on a repeat. Each
/// subkey has its own set, so sealers on different threads do not contend.
#[cfg(any(test, feature = "nonce-audit"))]
pub mod audit {
    use std::collections::{HashMap, HashSet};
    use std::sync::Arc;

    use tmem_lock::{Mutex, Rank};

    /// Stripes of a subkey's set, so threads sealing at once rarely meet.
    const STRIPES: usize = 64;

    /// The versions sealed under one subkey, striped by version.
    #[derive(Debug)]
    pub struct Versions([Mutex<Option<HashSet<u64>>>; STRIPES]);

    impl Default for Versions {
        fn default() -> Self {
            Self(std::array::from_fn(|_| Mutex::new(Rank::SealAudit, None)))
        }
    }

    impl Versions {
        pub(super) fn record(&self, version: u64, key_id: u32) {
            let stripe = &self.0[usize::try_from(version % STRIPES as u64).expect("< STRIPES")];
            let mut g = stripe.lock();
            let fresh = g.get_or_insert_with(HashSet::new).insert(version);
            assert!(fresh, "AEAD nonce reuse: version {version} sealed twice under one subkey (key id {key_id:#x})");
        }
    }

    /// Subkey fingerprint -> the versions sealed under it.
    static SUBKEYS: Mutex<Option<HashMap<[u8; 16], Arc<Versions>>>> = Mutex::new(Rank::SealAudit, None);

    /// The set of a subkey, shared by every sealer of it in this process.
    pub(super) fn versions_of(fingerprint: [u8; 16]) -> Arc<Versions> {
        let mut g = SUBKEYS.lock();
        Arc::clone(g.get_or_insert_with(HashMap::new).entry(fingerprint).or_default())
    }
}

fn parse_key(raw: &[u8]) -> Option<[u8; 32]> {
    if raw.len() == 32 {
        return raw.try_into().ok();
    }
    let text = std::str::from_utf8(raw).ok()?;
    let text = text.strip_suffix('\n').unwrap_or(text);
    if text.len() != 64 {
        return None;
    }
    let mut key = [0u8; 32];
    for (i, b) in key.iter_mut().enumerate() {
        *b = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(key)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    const K: TierKey = TierKey { pool: 1, object: 2, index: 3 };

    fn both() -> [SealAlgorithm; 2] {
        [SealAlgorithm::Aes256Gcm, SealAlgorithm::ChaCha20Poly1305]
    }

    #[test]
    fn an_adopted_sealer_opens_what_its_predecessor_sealed() {
        for alg in both() {
            let a = Sealer::with_algorithm(&MasterKey::random().unwrap(), alg).unwrap();
            let mut v = Vec::new();
            a.seal(K, 7, b"page", &mut v);
            let state = a.hand_over();
            let b = Sealer::adopt(&state).unwrap();
            assert_eq!((b.algorithm(), b.key_id(), b.salt()), (alg, a.key_id(), a.salt()));
            b.open(K, 7, &mut v).unwrap();
            assert_eq!(v, b"page");
            let other = Sealer::with_algorithm(&MasterKey::random().unwrap(), alg).unwrap();
            assert_ne!(Sealer::adopt(&other.hand_over()).unwrap().key_id(), a.key_id());
        }
        let mut state = Sealer::random().unwrap().hand_over();
        state[0] = 9;
        assert!(Sealer::adopt(&state).is_none());
    }

    #[test]
    fn seal_open_and_every_kind_of_misuse_fails() {
        let master = MasterKey::from_bytes([7; 32]);
        for alg in both() {
            let s = Sealer::with_algorithm(&master, alg).unwrap();
            let mut v = Vec::new();
            s.seal(K, 5, b"page bytes", &mut v);
            assert_eq!(v.len(), 10 + SEAL_OVERHEAD);
            assert_ne!(&v[..10], b"page bytes", "ciphertext differs from plaintext");
            let mut ok = v.clone();
            s.open(K, 5, &mut ok).unwrap();
            assert_eq!(ok, b"page bytes");
            // Tampered.
            let mut t = v.clone();
            t[3] ^= 1;
            assert!(matches!(s.open(K, 5, &mut t), Err(SealError::Auth)));
            assert!(t.is_empty(), "nothing is returned from a failed open");
            // Moved to another key.
            let mut m = v.clone();
            assert!(s.open(TierKey { index: 4, ..K }, 5, &mut m).is_err());
            // Replayed older version.
            let mut r = v.clone();
            assert!(s.open(K, 6, &mut r).is_err());
            // Another sealer of the same master key (another device or run).
            let mut o = v.clone();
            assert!(Sealer::with_algorithm(&master, alg).unwrap().open(K, 5, &mut o).is_err());
            // The same salt resumes the same subkey (hand-over).
            let mut h = v.clone();
            Sealer::resume(&master, alg, s.salt()).open(K, 5, &mut h).unwrap();
            assert_eq!(h, b"page bytes");
            assert!(matches!(s.open(K, 5, &mut vec![1, 2, 3]), Err(SealError::Short(3))));
        }
    }

    /// The keystream is the XOR of ciphertext and plaintext. Two sealers of
    /// one master key (two devices, or two runs with one key file) sealing
    /// the same pages at the same versions must share none of it.
    #[test]
    fn two_sealers_of_one_key_share_no_keystream() {
        let master = MasterKey::from_bytes([9; 32]);
        for alg in both() {
            let (a, b) = (Sealer::with_algorithm(&master, alg).unwrap(), Sealer::with_algorithm(&master, alg).unwrap());
            let page = vec![0x5au8; 4096];
            let (mut ca, mut cb) = (Vec::new(), Vec::new());
            let mut equal = 0usize;
            for version in 1..=64u64 {
                a.seal(K, version, &page, &mut ca);
                b.seal(K, version, &page, &mut cb);
                equal += ca.iter().zip(&cb).filter(|(x, y)| x == y).count();
            }
            // Independent streams agree on 1/256 of bytes by chance.
            let total = 64 * (4096 + SEAL_OVERHEAD);
            assert!(equal * 64 < total, "{alg:?}: {equal} of {total} bytes equal");
        }
    }

    #[test]
    #[should_panic(expected = "nonce reuse")]
    fn the_audit_catches_a_repeated_nonce() {
        let s = Sealer::new(&MasterKey::from_bytes([1; 32])).unwrap();
        let mut v = Vec::new();
        s.seal(K, 77, b"a", &mut v);
        s.seal(TierKey { index: 9, ..K }, 77, b"b", &mut v);
    }

    #[test]
    fn key_files_must_be_private_regular_and_exact() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("key");
        std::fs::write(&p, "00".repeat(31) + "ff\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(MasterKey::from_file(&p).unwrap_err().to_string().contains("chmod 600"));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let m = MasterKey::from_file(&p).unwrap();
        let (a, b) = (Sealer::new(&m).unwrap(), Sealer::resume(&m, Sealer::new(&m).unwrap().algorithm(), [0; 32]));
        let mut v = Vec::new();
        a.seal(K, 1, b"x", &mut v);
        Sealer::resume(&MasterKey::from_file(&p).unwrap(), a.algorithm(), a.salt()).open(K, 1, &mut v).unwrap();
        assert_ne!(a.key_id(), b.key_id());
        std::fs::write(&p, "short").unwrap();
        assert!(MasterKey::from_file(&p).unwrap_err().to_string().contains("5 bytes"));
        // Large files are refused by their size, not read.
        std::fs::File::options().write(true).open(&p).unwrap().set_len(3 << 30).unwrap();
        assert!(MasterKey::from_file(&p).unwrap_err().to_string().contains("3221225472 bytes"));
        // A symlink is refused, even to a good key.
        std::fs::write(&p, [3u8; 32]).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        assert!(MasterKey::from_file(&link).unwrap_err().to_string().contains("symbolic link"));
        // A FIFO is refused at once (it would block a plain open or read).
        let fifo = dir.path().join("fifo");
        rustix::fs::mkfifoat(rustix::fs::CWD, &fifo, rustix::fs::Mode::from_raw_mode(0o600)).unwrap();
        assert!(MasterKey::from_file(&fifo).unwrap_err().to_string().contains("not a regular file"));
        assert!(MasterKey::from_file(dir.path()).is_err());
        assert!(Sealer::random().is_ok());
    }
}
