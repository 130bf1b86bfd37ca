//! Sealing pages before they leave the process (to a remote node or to disk).
//!
//! ChaCha20-Poly1305 with a 256-bit key. The nonce is the page's *version*, a
//! number the store never reuses for one key (96 bits: 64-bit version and the
//! 32-bit key id). The associated data binds the key id, the pool, object and
//! index, and the version, so a value copied to another key, an older value
//! replayed under the same key, or a value sealed under another key fails to
//! open, exactly like a tampered one.
//!
//! Keys come from a key file that only its owner can read (32 raw bytes or 64
//! hex digits), or are generated per daemon run from the kernel's random
//! source: swap content must not outlive its daemon anyway.

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use chacha20poly1305::aead::{AeadInPlace, KeyInit};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce, Tag};

use crate::TierKey;

/// Bytes a sealed value adds to the plaintext (the Poly1305 tag).
pub const SEAL_OVERHEAD: usize = 16;

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
    /// No randomness for a generated key.
    #[error("cannot read /dev/urandom: {0}")]
    Random(std::io::Error),
    /// The value is not what was sealed under this key and version.
    #[error("authentication failed (tampered, moved to another key, or an older version)")]
    Auth,
    /// The value is too short to hold a tag.
    #[error("sealed value of {0} bytes is shorter than its tag")]
    Short(usize),
}

/// Seals and opens values for one AEAD key.
pub struct Sealer {
    cipher: ChaCha20Poly1305,
    key_id: u32,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer").field("key_id", &self.key_id).finish_non_exhaustive()
    }
}

impl Sealer {
    /// A sealer for `key`; `key_id` names the key (bound into every value).
    pub fn new(key: [u8; 32], key_id: u32) -> Self {
        Self { cipher: ChaCha20Poly1305::new(Key::from_slice(&key)), key_id }
    }

    /// A sealer with a fresh random key (per daemon run).
    pub fn random() -> Result<Self, SealError> {
        let mut buf = [0u8; 36];
        std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut buf)).map_err(SealError::Random)?;
        let mut key = [0u8; 32];
        key.copy_from_slice(&buf[..32]);
        Ok(Self::new(key, u32::from_le_bytes([buf[32], buf[33], buf[34], buf[35]])))
    }

    /// Loads a key from a file readable by its owner only (mode 0600 or 0400).
    pub fn from_key_file(path: &Path) -> Result<Self, SealError> {
        let err = |reason: String| SealError::KeyFile { path: path.display().to_string(), reason };
        let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
        if meta.mode() & 0o077 != 0 {
            return Err(err(format!("mode {:o} lets others read it; chmod 600", meta.mode() & 0o777)));
        }
        // SAFETY: geteuid has no preconditions.
        if meta.uid() != unsafe { libc::geteuid() } {
            return Err(err("not owned by the daemon's user".into()));
        }
        let raw = std::fs::read(path).map_err(|e| err(e.to_string()))?;
        let key = parse_key(&raw).ok_or_else(|| err("expected 32 raw bytes or 64 hex digits".into()))?;
        // The key id is derived from the key, so the same file always gives the same id.
        let id = key.chunks(4).fold(0u32, |acc, c| acc.rotate_left(5) ^ u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        Ok(Self::new(key, id))
    }

    /// The key id bound into every value.
    pub fn key_id(&self) -> u32 {
        self.key_id
    }

    fn nonce(&self, version: u64) -> [u8; 12] {
        let mut n = [0u8; 12];
        n[..8].copy_from_slice(&version.to_le_bytes());
        n[8..].copy_from_slice(&self.key_id.to_le_bytes());
        n
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
    /// `version` must never repeat for one key under one sealer.
    pub fn seal(&self, key: TierKey, version: u64, plain: &[u8], out: &mut Vec<u8>) {
        out.clear();
        out.extend_from_slice(plain);
        let tag = self
            .cipher
            .encrypt_in_place_detached(Nonce::from_slice(&self.nonce(version)), &self.aad(key, version), out)
            .expect("ChaCha20-Poly1305 accepts any page-sized message");
        out.extend_from_slice(&tag);
    }

    /// Opens a value sealed for (`key`, `version`) in place; on success
    /// `buf` holds the plaintext.
    pub fn open(&self, key: TierKey, version: u64, buf: &mut Vec<u8>) -> Result<(), SealError> {
        let n = buf.len().checked_sub(SEAL_OVERHEAD).ok_or(SealError::Short(buf.len()))?;
        let tag = *Tag::from_slice(&buf[n..]);
        buf.truncate(n);
        self.cipher
            .decrypt_in_place_detached(Nonce::from_slice(&self.nonce(version)), &self.aad(key, version), buf, &tag)
            .map_err(|_| {
                buf.clear();
                SealError::Auth
            })
    }
}

fn parse_key(raw: &[u8]) -> Option<[u8; 32]> {
    if raw.len() == 32 {
        return raw.try_into().ok();
    }
    let text = std::str::from_utf8(raw).ok()?.trim();
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

    #[test]
    fn seal_open_and_every_kind_of_misuse_fails() {
        let s = Sealer::new([7; 32], 9);
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
        // Another key (another daemon run).
        let mut o = v.clone();
        assert!(Sealer::new([8; 32], 9).open(K, 5, &mut o).is_err());
        assert!(matches!(s.open(K, 5, &mut vec![1, 2, 3]), Err(SealError::Short(3))));
    }

    #[test]
    fn key_files_must_be_private() {
        let dir = std::env::temp_dir().join(format!("tmem-seal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("key");
        std::fs::write(&p, "00".repeat(31) + "ff").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(Sealer::from_key_file(&p).unwrap_err().to_string().contains("chmod 600"));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let a = Sealer::from_key_file(&p).unwrap();
        let b = Sealer::from_key_file(&p).unwrap();
        let mut v = Vec::new();
        a.seal(K, 1, b"x", &mut v);
        b.open(K, 1, &mut v).unwrap();
        std::fs::write(&p, "short").unwrap();
        assert!(Sealer::from_key_file(&p).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(Sealer::random().is_ok());
    }
}
